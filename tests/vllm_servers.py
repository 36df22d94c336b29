"""Starting stock vLLM (the CPU build) for the integration suites, with tandem's connector or
without."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile

from prefill.vllm_launch import READY, free_port, vllm_args
from tests.servers import MODEL
from tools.launch import start

# Small on purpose: 1 GiB of KV cache, short contexts, and 64-token prefill chunks so that a
# prompt of a few hundred tokens is prefilled in several steps (chunked prefill).
MAX_BATCHED_TOKENS = 64
SMALL = ["--max-model-len", "512", "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]

# vLLM's processes talk over IPC sockets in VLLM_RPC_BASE_PATH (default: /tmp) and leave them
# there when stopped. A folder of this test process's own instead, removed at its exit; short
# (in /tmp, not Bazel's long TEST_TMPDIR), since a socket's path must fit in ~107 bytes.
_RPC_DIR = tempfile.mkdtemp(prefix="tandem-vllm-", dir="/tmp")
atexit.register(shutil.rmtree, _RPC_DIR, ignore_errors=True)


def start_vllm(transport: str | None, *extra: str) -> tuple[subprocess.Popen, str]:
    """vLLM serving the bundled model in float32 (the decode servers' dtype), with
    TandemConnector over `transport`, or without the connector (transport None); `extra`: more
    of vLLM's arguments."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_RPC_BASE_PATH=_RPC_DIR)
    if "TEST_TMPDIR" in os.environ:  # vLLM caches under $HOME, read-only in Bazel's sandbox
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(os.environ["TEST_TMPDIR"], "vllm")
    port = free_port("127.0.0.1")
    args = vllm_args(MODEL, "127.0.0.1", port, "float32", transport, *SMALL, *extra)
    proc, _ = start(args, READY, timeout=300)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as a user stops a server (vLLM then stops its engine processes)."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
