"""Transport benchmark: GB/s of one-sided writes between two processes, per backend, beside the
copy ceiling measured in the same run.

Cases: single writes of 4 MiB, 64 MiB and 1 GiB; one layer of a 1k-token prompt's KV for that
cache, as the prefill posts it (K and V: 2 x 2 MiB, two descriptors), which shows what a write
costs besides its bytes; and one 8k-token prompt's KV for a
Llama-3-8B-shaped cache (32 layers x K,V x 128 blocks of 64 tokens x 8 heads x 128 x bf16 =
1 GiB) sent three ways: one descriptor per (layer, K/V, block, head) run (65,536 x 16 KiB), one per
block to scattered destination blocks (8,192 x 128 KiB), and coalesced to contiguous blocks
(64 x 16 MiB). The ceiling is memcpy on the host, or a device-to-device copy on the GPU (plus
the pinned host-to-device copy), in the same process.

Each case reports the median of its repeats: the whole write (posted, then polled without
sleeping until done) and, apart, the time write() took to return (the poster thread's cost:
building the backend's request and posting it). Cases under 16 MiB repeat at least 100 times.

    python -m transport.bench --backends tcp,shm --out transport-bench.json
    python -m transport.bench --backends nixl --device cuda:0 --peer-device cuda:1   # GPUs
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import transport
from transport.base import WriteOp
from transport.memory import HostBuffer

GiB = 1 << 30
MiB = 1 << 20
KV = dict(layers=32, blocks=128, heads=8, block_bytes=64 * 128 * 2)  # a head-block: 16 KiB


@dataclass(frozen=True)
class Result:
    backend: str
    case: str
    descriptors: int
    nbytes: int
    seconds: float
    gb_s: float
    post_seconds: float
    """write() alone: until it returned, the transfer posted."""


class Memory:
    """A host buffer or a CUDA tensor of `nbytes`: its address, for registration."""

    def __init__(self, nbytes: int, device: str) -> None:
        self.device = device
        if device == "cpu":
            self._host = HostBuffer(nbytes)
            self.addr = self._host.addr
            ctypes.memset(self.addr, 1, nbytes)  # fault every page in: no zero-page reads
        else:
            import torch

            self._tensor = torch.ones(nbytes, dtype=torch.uint8, device=device)
            self.addr = self._tensor.data_ptr()
        self.nbytes = nbytes


def kv_cases() -> dict[str, list[tuple[int, int, int]]]:
    """(src offset, dst offset, nbytes) runs of one 8k-token prompt's KV, three ways."""
    run, heads, blocks = KV["block_bytes"], KV["heads"], KV["blocks"]
    block = run * heads
    planes = 2 * KV["layers"]  # (layer, K|V) planes of `blocks` blocks each
    plane = block * blocks
    scattered = random.Random(0).sample(range(blocks), blocks)
    return {
        "kv-per-head": [
            (p * plane + b * block + h * run, p * plane + scattered[b] * block + h * run, run)
            for p in range(planes)
            for b in range(blocks)
            for h in range(heads)
        ],
        "kv-per-block": [
            (p * plane + b * block, p * plane + scattered[b] * block, block)
            for p in range(planes)
            for b in range(blocks)
        ],
        "kv-coalesced": [(p * plane, p * plane, plane) for p in range(planes)],
    }


def single_cases() -> dict[str, list[tuple[int, int, int]]]:
    return {f"single-{n // MiB}MiB": [(0, 0, n)] for n in (4 * MiB, 64 * MiB, GiB)}


def layer_cases() -> dict[str, list[tuple[int, int, int]]]:
    """One layer of a 1k-token prompt, K then V, each one run of contiguous blocks."""
    plane = 1024 * KV["heads"] * KV["block_bytes"] // 64  # 1,024 tokens of all heads: 2 MiB
    return {"kv-layer-1k": [(0, 0, plane), (64 * MiB, 64 * MiB, plane)]}


def bench_backend(name: str, device: str, peer_device: str, repeats: int) -> list[Result]:
    receiver = subprocess.Popen(
        [sys.executable, "-m", "transport.bench", "--serve", name, "--device", peer_device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        hello = json.loads(receiver.stdout.readline())
        source = Memory(GiB, device)
        agent = transport.create(name)
        agent.register(source.addr, source.nbytes, device)
        peer = agent.connect(hello["endpoint"].encode(), time.monotonic() + 30)
        results = []
        for case, runs in {**single_cases(), **layer_cases(), **kv_cases()}.items():
            ops = [WriteOp(source.addr + s, hello["addr"] + d, n) for s, d, n in runs]
            nbytes = sum(n for _, _, n in runs)
            agent.write(peer, ops, time.monotonic() + 120).wait()  # warm-up
            times, posts = [], []
            for _ in range(repeats if nbytes >= 16 * MiB else max(repeats, 100)):
                start = time.perf_counter()
                transfer = agent.write(peer, ops, time.monotonic() + 120)
                posts.append(time.perf_counter() - start)
                transfer.wait(poll_interval=0)
                times.append(time.perf_counter() - start)
            seconds, post = statistics.median(times), statistics.median(posts)
            results.append(
                Result(name, case, len(ops), nbytes, seconds, nbytes / seconds / 1e9, post)
            )
            print(_row(results[-1]), flush=True)
        agent.close()
        return results
    finally:
        receiver.stdin.close()
        receiver.wait(timeout=30)


def ceilings(device: str) -> dict[str, float]:
    """GB/s of plain copies in this process: the limit a transport on this machine can reach."""
    if device == "cpu":
        src, dst = HostBuffer(GiB), HostBuffer(GiB)
        ctypes.memset(src.addr, 1, GiB)  # fault the pages in
        ctypes.memmove(dst.addr, src.addr, GiB)
        start = time.perf_counter()
        ctypes.memmove(dst.addr, src.addr, GiB)
        return {"memcpy_gb_s": GiB / (time.perf_counter() - start) / 1e9}
    import torch

    a = torch.ones(GiB, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    pinned = torch.ones(GiB, dtype=torch.uint8, pin_memory=True)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 5

    d2d = timed(lambda: b.copy_(a))
    h2d = timed(lambda: b.copy_(pinned, non_blocking=True))
    # A device copy reads and writes every byte: report both directions' traffic, as measured.
    return {
        "d2d_copy_read_plus_write_gb_s": 2 * GiB / d2d / 1e9,
        "h2d_pinned_gb_s": GiB / h2d / 1e9,
    }


def serve(name: str, device: str) -> None:
    """Receiver: registers 1 GiB, prints its endpoint, exits when stdin closes."""
    memory = Memory(GiB, device)
    agent = transport.create(name)
    agent.register(memory.addr, memory.nbytes, device)
    print(json.dumps({"endpoint": agent.endpoint().decode(), "addr": memory.addr}), flush=True)
    sys.stdin.read()
    agent.close()


def _row(r: Result) -> str:
    return (
        f"{r.backend:<9} {r.case:<14} {r.descriptors:>7} {r.nbytes / MiB:>8.0f} MiB "
        f"{r.seconds * 1e3:>9.3f} ms {r.gb_s:>8.2f} GB/s  posted in {r.post_seconds * 1e3:.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tcp,shm", help="comma-separated backend names")
    parser.add_argument("--device", default="cpu", help="sender memory: cpu or cuda:N")
    parser.add_argument("--peer-device", default=None, help="receiver memory (default: --device)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="transport-bench.json")
    parser.add_argument("--serve", metavar="BACKEND", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.device)
        return
    peer_device = args.peer_device or args.device
    limits = ceilings(args.device)
    print("ceilings: " + ", ".join(f"{k} {v:.2f}" for k, v in limits.items()), flush=True)
    print(f"{'backend':<9} {'case':<14} {'descr':>7} {'size':>12} {'time':>12} {'rate':>13}")
    results = []
    for name in args.backends.split(","):
        results += bench_backend(name, args.device, peer_device, args.repeats)
    with open(args.out, "w") as f:
        json.dump(
            {
                "device": args.device,
                "peer_device": peer_device,
                "host": os.uname().nodename,
                "ceilings": limits,
                "results": [asdict(r) for r in results],
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
