"""Weight-streaming benchmark: one bs=1 decode step's matrix-vector products, engine vs cuBLAS.

Every layer's qkv, o, gate_up and down matrices (distinct random weights per layer, so nothing
stays in L2) and the lm_head, launched back to back in one CUDA graph, as in a decode step:
once through engine.triton_linear's GEMV and once through cuBLAS (F.linear), in the same run.
Each figure is bytes of weights over time, also as a fraction of the HBM read bandwidth that
engine.bench measures. Per matrix shape too (all layers' copies of that shape in one graph).
`tandem-fp8` streams the layers' matrices quantized to e4m3 with 128x128 block scales (an FP8
checkpoint's), the lm_head in bf16 as FP8 checkpoints keep it: its bytes count the scales.

`--rows R` streams products of R rows instead (a speculative verification's k + 1 positions):
the engine's few-row kernel (engine.triton_gemv_rows) against cuBLAS; `--sweep` also times each
of that kernel's candidate configurations per shape and prints the fastest.

    python -m engine.gemv_bench --model llama3-8b --out gemv.json
    python -m engine.gemv_bench --model llama3-8b --rows 4 --sweep --out gemv-rows4.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.fp8 import Fp8Scheme, Fp8Weight, quantize
from engine.roofline import read_bandwidth

LAYER_MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def matrix_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each matrix a decode step streams."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
        "lm_head": (config.vocab_size, hidden),
    }


def graph_seconds(fn, repeats: int = 20) -> float:
    """Median time of one replay of a graph capturing fn()."""
    fn()  # warm-up: compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


# The few-row kernel's candidates: (rows of W per program, K step, warps, pipeline stages).
SWEEP = [
    (block_n, block_k, warps, stages)
    for block_n in (16, 32, 64)
    for block_k in (128, 256, 512)
    for warps in (4, 8)
    for stages in (2, 3, 4)
    if block_n * block_k <= 16384
]


def run(config: ModelConfig, num_layers: int, rows: int = 1, sweep: bool = False) -> dict:
    from engine import triton_linear  # imports Triton: CUDA only

    shapes = matrix_shapes(config)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weights(name: str, copies: int) -> list[torch.Tensor]:
        out, inp = shapes[name]
        return [
            torch.randn(out, inp, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            for _ in range(copies)
        ]

    stack = {name: weights(name, num_layers) for name in LAYER_MATRICES}
    stack["lm_head"] = weights("lm_head", 1)
    inputs = {
        width: torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, generator=gen)
        for width in {inp for _, inp in shapes.values()}
    }
    fp8_stack = {name: [_fp8(w) for w in stack[name]] for name in LAYER_MATRICES}
    fp8_stack["lm_head"] = stack["lm_head"]
    systems = {
        "tandem": (triton_linear.linear, stack),
        "cublas": (F.linear, stack),
        "tandem-fp8": (triton_linear.linear, fp8_stack),
    }
    if rows > 1:  # the few-row kernel, whether or not the engine runs it yet
        from engine import triton_gemv_rows

        systems["rows-kernel"] = (lambda x, w: triton_gemv_rows.launch(x, w, None), stack)
    bandwidth = read_bandwidth("cuda")

    def stream(linear, matrices, names):
        total = sum(_bytes(w) for n in names for w in matrices[n])

        def step():
            for i in range(num_layers):
                for n in names:
                    if i < len(matrices[n]):
                        w = matrices[n][i]
                        linear(inputs[w.shape[1]], w)

        seconds = graph_seconds(step)
        rate = total / seconds
        return {"ms": seconds * 1e3, "tb_s": rate / 1e12, "of_bandwidth": rate / bandwidth}

    results = {
        system: {"step": stream(linear, matrices, [*LAYER_MATRICES, "lm_head"])}
        | {name: stream(linear, matrices, [name]) for name in shapes}
        for system, (linear, matrices) in systems.items()
    }
    report = {"read_bandwidth_tb_s": bandwidth / 1e12, "layers": num_layers, "rows": rows}
    if sweep and rows > 1:
        report["sweep"] = {name: _sweep(stream, stack, name) for name in shapes}
    return report | {"results": results}


def _sweep(stream, stack, name: str) -> dict[str, float]:
    """Each candidate's share of the bandwidth on one shape; those that cannot run there (too
    much shared memory for the rows) left out."""
    from triton.runtime.errors import OutOfResources

    from engine import triton_gemv_rows

    shares = {}
    for candidate in SWEEP:

        def launch(x, w, c=candidate):
            return triton_gemv_rows.launch(x, w, None, config=c)

        with contextlib.suppress(OutOfResources):  # raised by the eager call, before a capture
            shares[str(list(candidate))] = stream(launch, stack, [name])["of_bandwidth"]
    return shares


def _fp8(weight: torch.Tensor) -> Fp8Weight:
    """weight as an FP8 checkpoint stores it: e4m3, a scale per 128x128 block."""
    scheme = Fp8Scheme(128, 128)
    values, scale = quantize(weight, scheme)
    return scheme.matrix(values, scheme.expand_scale(scale, weight.shape[0]).contiguous())


def _bytes(weight: torch.Tensor | Fp8Weight) -> int:
    if isinstance(weight, Fp8Weight):
        return weight.weight.numel() + weight.scale.numel() * weight.scale.element_size()
    return weight.numel() * weight.element_size()


def print_table(report: dict) -> None:
    print(f"HBM read bandwidth (measured): {report['read_bandwidth_tb_s']:.2f} TB/s; "
          f"rows: {report['rows']}")  # fmt: skip
    for name, shares in report.get("sweep", {}).items():
        best = sorted(shares, key=shares.get, reverse=True)[:3]
        print(f"sweep {name:12} " + "  ".join(f"{c} {shares[c]:.1%}" for c in best))
    print(f"{'matrices':14} {'system':10} {'ms':>8} {'TB/s':>6} {'of bw':>6}")
    for name in report["results"]["tandem"]:  # the whole step first, then each shape
        for system, rows in report["results"].items():
            ms, tb_s, share = (rows[name][k] for k in ("ms", "tb_s", "of_bandwidth"))
            print(f"{name:14} {system:10} {ms:8.3f} {tb_s:6.2f} {share:6.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="a ModelConfig preset name")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's")
    parser.add_argument("--rows", type=int, default=1, help="rows of each product's input")
    parser.add_argument("--sweep", action="store_true",
                        help="with --rows > 1: time the few-row kernel's settings")  # fmt: skip
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_bench: needs a CUDA GPU (it times CUDA graphs of GPU kernels)", file=sys.stderr)
        return 2
    config = ModelConfig.preset(args.model)
    report = run(config, args.layers or config.num_layers, args.rows, args.sweep)
    print_table(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
