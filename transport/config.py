"""The KV transport settings a server takes (the decode server and tandem's prefill alike):
one frozen config, its command-line flags, validated once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from transport import BACKENDS, check_name, create
from transport.base import Transport


@dataclass(frozen=True)
class KvTransportConfig:
    backend: str = "tcp"
    """KV transport backend: tcp, shm, nixl or mooncake (every peer must use the same)."""
    host: str = "127.0.0.1"
    """Interface the server listens on, its transport's listener included."""
    transfer_timeout_s: float = 30.0
    """Longest one request's KV transfer may take (a ticket's own deadline also holds)."""

    def __post_init__(self) -> None:
        check_name(self.backend)
        if not self.host:
            raise ValueError("host: must not be empty")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s: {self.transfer_timeout_s} must be > 0")

    def create(self) -> Transport:
        return create(self.backend, host=self.host)

    def create_registered(self, regions: list[tuple[int, int]], device: str) -> Transport:
        """A transport with `regions` (address, bytes) on `device` registered: a server's
        whole KV cache (and its speculative proposer's)."""
        transport = self.create()
        for region in regions:
            transport.register(*region, device)
        return transport

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--transport", default="tcp", help=", ".join(BACKENDS))
        parser.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> KvTransportConfig:
        return cls(args.transport, args.host, args.transfer_timeout)
