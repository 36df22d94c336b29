"""tandem's connector settings: vLLM's `kv_connector_extra_config`, parsed and validated once.

    --kv-transfer-config '{"kv_connector": "TandemConnector",
                           "kv_connector_module_path": "prefill.vllm_connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"transport": "tcp"}}'

A bad value raises ValueError naming the key when the connector is built, which stops vLLM at
start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import transport


@dataclass(frozen=True)
class TandemConnectorConfig:
    transport: str = "tcp"
    """KV transport backend; the decode servers' (tcp, shm, nixl or mooncake)."""
    host: str = "127.0.0.1"
    """Address the transport agent binds, where the backend binds anything."""
    staging_mb: float = 64.0
    """Memory (on the KV cache's device, registered with the transport) that KV converted to
    the decode server's layout waits in until its write has completed."""
    staging_slots: int = 8
    """Writes in flight at once: the staging memory is cut into this many equal slots. A slot
    holds one layer's K and V of a run of tokens; longer runs take several slots."""
    transfer_timeout_s: float = 30.0
    """Longest a request's writes and commit may take (the ticket's own deadline also holds)."""

    def __post_init__(self) -> None:
        transport.check_name(self.transport)
        if not self.host:
            raise ValueError("host: must not be empty")
        if not self.staging_mb > 0:
            raise ValueError(f"staging_mb: {self.staging_mb} must be > 0")
        if self.staging_slots < 1:
            raise ValueError(f"staging_slots: {self.staging_slots} must be >= 1")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s: {self.transfer_timeout_s} must be > 0")

    @property
    def slot_bytes(self) -> int:
        return int(self.staging_mb * (1 << 20)) // self.staging_slots

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> TandemConnectorConfig:
        """From `kv_connector_extra_config`; unknown keys and values of the wrong type are
        refused by name."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} "
                f"(known: {', '.join(fields)})"
            )
        values = {}
        for key, value in extra.items():
            kind = type(fields[key].default)
            accepted = (int, float) if kind is float else kind  # JSON writes 64.0 as 64
            if isinstance(value, bool) or not isinstance(value, accepted):
                raise ValueError(
                    f"kv_connector_extra_config: {key} must be of type {kind.__name__}, "
                    f"got {value!r}"
                )
            values[key] = kind(value)
        return cls(**values)
