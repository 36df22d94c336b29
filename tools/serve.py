"""The whole stack on one machine: decode server(s), prefill server(s) and the router, on free
ports, with the bundled SmolLM2 unless --model names a Hugging Face folder.

    ./bazelw run //tools:serve                      # or: python -m tools.serve
    ./bazelw run //tools:serve -- --model DIR --device cuda --transport nixl --port 8000
    ./bazelw run //tools:serve -- --prefill vllm    # stock vLLM prefills, with tandem's connector
    ./bazelw run //tools:serve -- --aggregated      # router + decode only: decode prefills too
    ./bazelw run //tools:serve -- --model DIR --decode-tp 2 --prefill-tp 2   # tensor-parallel
    ./bazelw run //tools:serve -- --model DIR --speculative-config '{"method": "mtp",
        "num_speculative_tokens": 3}'    # the prefill sends the MTP layers' prompt KV

Prints `tandem ready: http://HOST:PORT` once the router answers (and the decode servers'
Prometheus /metrics URLs; the router serves its own at /metrics); Ctrl-C (or SIGTERM) stops every
component. If one cannot start, or dies, everything stops with its last words.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from prefill.ticket import PROPOSER_KV_METHODS
from prefill.vllm_launch import READY, free_port, vllm_args
from tools.launch import start, stop

SMOLLM2 = "smollm2"


def _model_folder(model: str) -> str:
    if model != SMOLLM2:
        return model
    from tools.convert import MissingPackageError, default_cache_dir, ensure_smollm2

    try:
        return str(ensure_smollm2(default_cache_dir()))
    except MissingPackageError as e:
        sys.exit(f"serve: {e}")


def _start_vllm(
    model: str, host: str, dtype: str, transport: str, kv_cache_gb: str, spec: list, *extra: str
):
    """Stock vLLM with tandem's connector; its KV cache size, on the CPU build, in whole GiB;
    `spec`: [] or ["--speculative-config", JSON]."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(float(kv_cache_gb)))))
    # vLLM's automatic CPU binding wants a NUMA node per tensor-parallel rank.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    port = free_port(host)
    speculative = spec[1] if spec else None
    args = vllm_args(model, host, port, dtype, transport, *extra, speculative_config=speculative)
    proc, _ = start(args, READY, timeout=900)
    return proc, f"http://{host}:{port}"


def _proposer_needs_prompt_kv(speculative_config: str | None) -> bool:
    """Whether the decode's proposer reads a prompt KV of its own (a draft model, MTP layers),
    which the prefill must compute and send; a malformed JSON is the decode server's to refuse."""
    try:
        return json.loads(speculative_config or "{}").get("method") in PROPOSER_KV_METHODS
    except (ValueError, AttributeError):
        return False


_PREFILL_FLAGS = ("prefill", "num_prefill", "prefill_tp", "prefill_kv_cache_gb", "kv_send")
"""Flags that configure the prefills, which --aggregated does not start."""


def _configuration_problem(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """What in the command line cannot work, naming the flags to change; None if nothing.
    Checked before any server starts (a model loads in seconds to minutes)."""
    if min(args.num_prefill, args.num_decode, args.decode_tp, args.prefill_tp) < 1:
        return "--num-prefill, --num-decode, --decode-tp and --prefill-tp must be >= 1"
    if not 0 <= args.port <= 65535:
        return f"--port {args.port} is not a port number (0: any free one)"
    changed = [f for f in _PREFILL_FLAGS if getattr(args, f) != parser.get_default(f)]
    if args.aggregated and changed:
        return ("--aggregated starts no prefill: drop it, or the prefill's flags (--prefill, "
                "--num-prefill, --prefill-tp, --prefill-kv-cache-gb, --kv-send)")  # fmt: skip
    if args.prefill == "vllm" and args.kv_send != "layerwise":
        return "--kv-send is the embedded prefill's; vLLM's connector sends each step"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="tools/serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SMOLLM2, help="HF folder, or smollm2 (bundled)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--prefill", choices=["embedded", "vllm"], default="embedded")
    parser.add_argument("--transport", default="tcp", help="tcp, shm, nixl or mooncake")
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--aggregated", action="store_true",
                        help="no prefill: the decode servers prefill every request")  # fmt: skip
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1,
                        help="each decode server's tensor-parallel size (ranks, GPUs)")  # fmt: skip
    parser.add_argument("--prefill-tp", type=int, default=1,
                        help="each prefill's tensor-parallel size (vLLM's too)")  # fmt: skip
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights of the folder's shape")  # fmt: skip
    parser.add_argument("--max-model-len", default=None, help="default: the model's")
    parser.add_argument("--kv-cache-gb", default="1", help="each engine's KV cache, GB")
    parser.add_argument("--prefill-kv-cache-gb", default=None,
                        help="the prefills' KV cache, GB, where it differs from the decode's: a "
                             "prefill holds the prompts of one forward, a decode server every "
                             "running sequence")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, or fp8 (every engine's)")
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="every engine reuses the KV of prompt blocks it computed before",
    )
    parser.add_argument("--speculative-config", default=None,
                        help="JSON, the decode's (and, for draft_model, mtp and eagle3, the "
                             "prefill's: it sends the proposer's prompt KV)")  # fmt: skip
    parser.add_argument("--kv-send", default="layerwise",
                        help="the embedded prefill's: layerwise, chunkwise or after-forward "
                             "(prefill.server --help)")  # fmt: skip
    parser.add_argument("--tool-call-parser", default=None, help="the router's (hermes, ...)")
    parser.add_argument("--reasoning-parser", default=None, help="the router's (qwen3, ...)")
    parser.add_argument("--generation-config", default="auto",
                        help="the router's: unset sampling fields take the model's "
                        "generation_config.json (auto; then temperature 1), OpenAI's defaults "
                        "(vllm) or a folder's")  # fmt: skip
    args = parser.parse_args()
    problem = _configuration_problem(args, parser)
    if problem:
        sys.exit(f"serve: {problem}")
    num_prefill = 0 if args.aggregated else args.num_prefill
    model = _model_folder(args.model)
    if not (Path(model) / "config.json").is_file():
        sys.exit(f"serve: --model {model} is not a Hugging Face folder (no config.json)")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    common = ["--model", model, "--host", args.host, "--device", args.device, "--dtype", dtype,
              "--transport", args.transport, "--kv-cache-dtype", args.kv_cache_dtype]  # fmt: skip
    prefill_kv_gb = args.prefill_kv_cache_gb or args.kv_cache_gb
    # Flags vLLM takes under the same names.
    shared = ["--load-format", args.load_format]
    if args.max_model_len:
        shared += ["--max-model-len", args.max_model_len]
    if args.enable_prefix_caching:
        shared.append("--enable-prefix-caching")
    common += shared
    spec = ["--speculative-config", args.speculative_config] if args.speculative_config else []
    # A draft model, MTP layers or an EAGLE-3 head need the prompt's KV of their own, which the
    # prefill computes.
    prefill_spec = spec if _proposer_needs_prompt_kv(args.speculative_config) else []
    procs = []
    stopping = threading.Event()

    def stop_all(*_: object) -> None:
        stopping.set()
        stop(procs, grace=15)

    signal.signal(signal.SIGTERM, lambda *_: (stop_all(), sys.exit(0)))
    try:
        decodes, metrics = [], []
        prefills = ["--aggregated"] if args.aggregated else []  # the router's prefill arguments
        for _ in range(args.num_decode):
            proc, m = start(["decode.server", *common, "--kv-cache-gb", args.kv_cache_gb,
                             "--grpc-port", "0", "--metrics-port", "0",
                             "--tensor-parallel-size", str(args.decode_tp), *spec],
                            r"serving gRPC on [\d.]+:(\d+), metrics on :(\d+)",
                            timeout=900)  # fmt: skip
            procs.append(proc)
            decodes += ["--decode", f"{args.host}:{m.group(1)}"]
            metrics.append(f"http://{args.host}:{m.group(2)}/metrics")
        for _ in range(num_prefill):
            prefill_tp = ["--tensor-parallel-size", str(args.prefill_tp)]
            if args.prefill == "vllm":
                proc, url = _start_vllm(model, args.host, dtype, args.transport,
                                        prefill_kv_gb, prefill_spec, "--kv-cache-dtype",
                                        args.kv_cache_dtype, *shared, *prefill_tp)  # fmt: skip
            else:
                proc, m = start(["prefill.server", *common, "--kv-cache-gb", prefill_kv_gb,
                                 "--port", "0", *prefill_tp,
                                 *prefill_spec, "--kv-send", args.kv_send],
                                r"serving on (http://\S+)", timeout=900)  # fmt: skip
                url = m.group(1)
            procs.append(proc)
            prefills += ["--prefill", url]
        parsers = [f"--{name.replace('_', '-')}={value}" for name, value in (
            ("tool_call_parser", args.tool_call_parser),
            ("reasoning_parser", args.reasoning_parser),
            ("generation_config", args.generation_config)) if value]  # fmt: skip
        proc, m = start(["router.server", "--model", model, "--host", args.host,
                         "--port", str(args.port), "--served-model-name", Path(model).name,
                         *prefills, *decodes, *parsers],
                        r"serving on (http://\S+)", timeout=300)  # fmt: skip
        procs.append(proc)
    except RuntimeError as e:
        stop_all()
        sys.exit(f"serve: a component could not start: {e}")
    print(f"tandem ready: {m.group(1)} (decode metrics: {' '.join(metrics)})", flush=True)
    try:
        while not stopping.is_set():
            for proc in procs:
                if proc.poll() is not None:
                    stop_all()
                    sys.exit(f"serve: {proc.args[2]} exited with {proc.returncode}; stopped all")
            stopping.wait(1.0)
    except KeyboardInterrupt:
        stop_all()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
