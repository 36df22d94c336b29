"""Handover benchmark: what disaggregation costs a request, against prefill alone on the same
engine, in the same run.

Starts a decode server and a prefill server (as `python -m ...`, on the given device and
transport) and, for each prompt length, times:
  prefill_alone_ms  POST /v1/completions, max_tokens=1, no ticket: the prefill engine by itself
  disagg_ttft_ms    Reserve + POST with the ticket, which returns once every layer's KV landed
                    and was committed: the first token as the client sees it
  overhead_ms       disagg_ttft_ms - prefill_alone_ms (target: under 5% of the prefill)
  reserve_ms        the Reserve RPC alone (part of disagg_ttft_ms)
  transfer_tail_ms  the prefill's own report: first layer's writes to last completion
  send_wait_ms      the prefill's own report: after its forward, waiting for the last writes
  commit_ms         the prefill's own report: sending the commit (a transport notification
                    where the decode server takes one, else the Commit RPC)
  prepare_ms, post_ms, write_ops, posts   the prefill's sender thread: building the write
                    descriptors, handing them to the transport, how many (all layers) and in how
                    many transport writes
  first_token_ms    prefill reply -> Generate's first message (the prefill's token, streamed by the
                    decode server once it admitted the request): what a client waits on top of
                    disagg_ttft_ms for its first token
  handover_ms       prefill reply -> the first token computed by the decode server
  forward_alone_ms, forward_ms   the prefill's own Server-Timing: admitted to first token
                    sampled, alone and with the ticket (what sending beside the forward costs it)
  send_tail_ms      the prefill's Server-Timing: first token sampled -> writes landed and committed
  rpc_ms            a Stats round trip to the decode server just before Reserve (gRPC's floor)
Median of `--repeats` after a warm-up; prints a table and writes JSON. With both `--kv-send`
modes it also shows what sending each layer as it is computed buys over sending after the
whole forward.

    python -m tools.handover_bench --model random:llama3-8b --device cuda --transport nixl \
        --prompt-lens 1024,8192 --out handover.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import grpc
import httpx

from prefill import server_timing
from prefill.ticket import transfer_params
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tools.launch import exit_on_sigterm, start, stop


def measure(stub, http, address: str, prompt: list[int], tag: str) -> dict:
    start = time.perf_counter()
    reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    reply.raise_for_status()
    alone = time.perf_counter() - start
    forward_alone = server_timing.parse(reply.headers["server-timing"])["forward"]

    start = time.perf_counter()
    stub.Stats(decode_pb2.StatsRequest(), timeout=60)
    rpc = time.perf_counter() - start

    start = time.perf_counter()
    request = decode_pb2.ReserveRequest(
        request_id=tag, prompt_token_ids=prompt, num_senders=1, max_tokens=2
    )
    ticket = stub.Reserve(request, timeout=60).ticket
    reserved = time.perf_counter()
    params = transfer_params(ticket, address)
    reply = http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params})  # fmt: skip
    reply.raise_for_status()
    ttft = time.perf_counter() - start
    kv = reply.json()["kv_transfer_params"]
    timing = server_timing.parse(reply.headers["server-timing"])
    replied = time.perf_counter()
    stream = stub.Generate(decode_pb2.GenerateRequest(
        request_id=tag, generation=ticket.generation, first_token_id=kv["first_token_id"],
        max_tokens=2, ignore_eos=True), timeout=60)  # fmt: skip
    tokens = 0
    first_token = handover = None
    for message in stream:
        tokens += len(message.token_ids)
        if tokens >= 1 and first_token is None:
            first_token = time.perf_counter() - replied
        if tokens >= 2 and handover is None:
            handover = time.perf_counter() - replied
    return {
        "prefill_alone_ms": alone * 1e3,
        "disagg_ttft_ms": ttft * 1e3,
        "overhead_ms": (ttft - alone) * 1e3,
        "reserve_ms": (reserved - start) * 1e3,
        "rpc_ms": rpc * 1e3,
        "forward_alone_ms": forward_alone,
        "forward_ms": timing["forward"],
        "send_tail_ms": timing["send"],
        "transfer_tail_ms": kv["transfer_ms"],
        "send_wait_ms": kv["send_wait_ms"],
        "commit_ms": kv["commit_ms"],
        "prepare_ms": kv["prepare_ms"],
        "post_ms": kv["post_ms"],
        "write_ops": kv["write_ops"],
        "posts": kv["posts"],
        "first_token_ms": first_token * 1e3,
        "handover_ms": handover * 1e3,
        "kv_bytes": kv["bytes_written"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--transport", default="nixl")
    parser.add_argument("--kv-cache-gb", default="8")
    parser.add_argument("--prompt-lens", default="1024,8192")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--kv-send", default="layerwise,after-forward",
        help="prefill send modes to compare: layerwise, chunkwise, after-forward",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="the prefill's tokens a forward (default: the longest prompt, one forward each; "
        "tools/serve's servers take 2048)",
    )  # fmt: skip
    parser.add_argument("--out", default="handover.json")
    args = parser.parse_args()
    exit_on_sigterm()
    lens = [int(n) for n in args.prompt_lens.split(",")]
    chunk = args.max_num_batched_tokens or max(lens)
    common = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
              "--kv-cache-gb", args.kv_cache_gb, "--transport", args.transport,
              "--max-model-len", str(max(lens) + 64), "--max-num-batched-tokens", str(chunk),
              "--max-num-seqs", str(min(256, chunk))]  # fmt: skip
    decode, m = start(["decode.server", *common], r"serving gRPC on [\d.]+:(\d+)", 600)
    address = f"127.0.0.1:{m.group(1)}"
    stub = decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(address))
    rng = random.Random(0)
    prompts = {n: [rng.randrange(1, 200) for _ in range(n)] for n in lens}  # any vocabulary
    results = []
    try:
        for mode in args.kv_send.split(","):
            prefill, m = start(
                ["prefill.server", *common, "--port", "0", "--kv-send", mode],
                r"serving on (\S+)",
                600,
            )
            http = httpx.Client(base_url=m.group(1), timeout=600)
            try:
                for n in lens:
                    results.append(bench_point(stub, http, address, prompts[n], mode, args))
            finally:
                stop([prefill])
    finally:
        stop([decode])
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)


def bench_point(stub, http, address: str, prompt: list[int], mode: str, args) -> dict:
    n = len(prompt)
    measure(stub, http, address, prompt, f"warm-{mode}-{n}")
    runs = [measure(stub, http, address, prompt, f"{mode}-{n}-{i}") for i in range(args.repeats)]
    row = {"kv_send": mode, "prompt_len": n}
    for key in runs[0]:
        row[key] = statistics.median(r[key] for r in runs)
    row["overhead_pct"] = 100 * row["overhead_ms"] / row["prefill_alone_ms"]
    print(
        f"{mode:>13} prompt {n:>6}: prefill alone {row['prefill_alone_ms']:8.1f} ms  "
        f"disaggregated TTFT {row['disagg_ttft_ms']:8.1f} ms  "
        f"overhead {row['overhead_ms']:6.1f} ms ({row['overhead_pct']:.1f}%)  "
        f"forward {row['forward_alone_ms']:6.1f} alone {row['forward_ms']:6.1f} sending  "
        f"send tail {row['send_tail_ms']:5.1f} ms  "
        f"reserve {row['reserve_ms']:5.1f} ms (rpc {row['rpc_ms']:4.1f})  "
        f"transfer {row['transfer_tail_ms']:6.1f} ms  "
        f"send wait {row['send_wait_ms']:5.1f} ms  commit {row['commit_ms']:5.1f} ms  "
        f"(descriptors: {row['write_ops']:.0f} in {row['posts']:.0f} posts, built in "
        f"{row['prepare_ms']:.1f} ms, posted in {row['post_ms']:.1f} ms)  "
        f"first token +{row['first_token_ms']:4.1f} ms  handover {row['handover_ms']:6.1f} ms  "
        f"KV {row['kv_bytes'] / 2**20:.0f} MiB",
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
