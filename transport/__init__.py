"""KV data plane: the Transport interface (transport.base) and its backends, chosen by name.

    from transport import create
    with create("tcp", host="127.0.0.1") as t: ...

Backends are imported only when asked for: nixl and mooncake load native libraries that a
machine running another backend need not have.
"""

from __future__ import annotations

import importlib

from transport.base import Transport

BACKENDS = {
    "tcp": "transport.tcp.backend:TcpTransport",
    "shm": "transport.shm.backend:ShmTransport",
    "nixl": "transport.nixl.backend:NixlTransport",
    "mooncake": "transport.mooncake.backend:MooncakeTransport",
}


def check_name(name: str) -> None:
    """Raises ValueError naming the known backends unless `name` is one (for config checks)."""
    if name not in BACKENDS:
        raise ValueError(f"transport: {name!r} is not one of {', '.join(BACKENDS)}")


def create(name: str, host: str = "127.0.0.1", **options: object) -> Transport:
    """A new agent of backend `name`, bound to `host` where the backend binds anything."""
    check_name(name)
    module, _, cls = BACKENDS[name].partition(":")
    try:
        backend = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"transport: backend {name!r} is not available here: {e}") from None
    return backend(host=host, **options)
