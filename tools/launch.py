"""Starting tandem's servers as child processes, waiting until each says it serves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time


def start(
    args: list[str], ready: str, timeout: float = 120, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, re.Match]:
    """Runs `python -m ARGS...` (after `prefix`, e.g. `ip netns exec NS`) and waits for a stdout
    line matching `ready`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR"}
    env.update(NIXL_LOG_LEVEL="WARN", UCX_LOG_FILE="stderr")
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            raise RuntimeError(f"{args[0]} exited with {proc.returncode}: {''.join(lines)}")
        lines.append(line)
        if match := re.search(ready, line):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining
            return proc, match
    proc.kill()
    raise RuntimeError(f"{args[0]} not ready in {timeout} s: {''.join(lines)}")
