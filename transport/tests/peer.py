"""The receiving side of the conformance suite, as a separate process.

    python -m transport.tests.peer BACKEND NBYTES

Registers a zeroed host buffer of NBYTES, prints its endpoint as one JSON line, then answers
commands on stdin, one JSON line each:
  {"cmd": "crc", "offset": O, "nbytes": N}  -> {"crc": zlib.crc32 of buffer[O:O+N]}
  {"cmd": "notifications"}                 -> {"notifications": [hex payloads]}
  {"cmd": "base"}                          -> {"addr": buffer address}
  {"cmd": "exit"}                          -> closes the transport and exits
"""

from __future__ import annotations

import json
import sys
import zlib

import transport
from transport.memory import HostBuffer


def main() -> None:
    backend, nbytes = sys.argv[1], int(sys.argv[2])
    buffer = HostBuffer(nbytes)
    agent = transport.create(backend)
    agent.register(buffer.addr, buffer.nbytes)
    _reply({"endpoint": agent.endpoint().decode(), "addr": buffer.addr})
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "crc":
            start = request["offset"]
            _reply({"crc": zlib.crc32(buffer.view()[start : start + request["nbytes"]])})
        elif request["cmd"] == "notifications":
            _reply({"notifications": [n.hex() for n in agent.notifications()]})
        elif request["cmd"] == "exit":
            break
    agent.close()
    _reply({"closed": True})


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
