"""Load through the whole CPU stack: 500 requests at concurrency 32, driven by `tools.bench` as a
user would run it, with zero errors; afterwards the decode server's KV pool is all free. The
bench's figures are printed (see docs/performance.md for a recorded run)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.servers import MODEL, decode_pool_free, start_decode, start_prefill, start_router

REQUESTS, CONCURRENCY, INPUT_LEN, OUTPUT_LEN = 500, 32, 48, 12


def test_500_requests_at_concurrency_32_without_errors_and_no_leaked_blocks(tmp_path):
    decode, address = start_decode("tcp")
    prefill, prefill_url = start_prefill("tcp")
    router, url = start_router([prefill_url], [address])
    try:
        results = tmp_path / "load.json"
        bench = subprocess.run(
            [sys.executable, "-m", "tools.bench.main", "--base-url", url, "--dataset", "random",
             "--num-prompts", str(REQUESTS), "--max-concurrency", str(CONCURRENCY),
             "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
             "--tokenizer", MODEL, "--seed", "7", "--result-json", str(results)],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        print(bench.stdout)
        assert bench.returncode == 0, bench.stderr[-2000:]
        summary = json.loads(results.read_text())["summary"]
        assert summary["errors"] == {} and summary["failed"] == 0 and summary["not_sent"] == 0
        assert summary["completed"] == REQUESTS
        assert summary["output_tokens"] == REQUESTS * OUTPUT_LEN
        stats = decode_pool_free(address)
        assert stats is not None, "KV blocks still allocated after every request ended"
        assert stats.running == stats.waiting == 0
        assert stats.tokens_generated >= REQUESTS * (OUTPUT_LEN - 1)  # the first is prefill's
    finally:
        for proc in (router, prefill, decode):
            proc.terminate()
            proc.wait(timeout=10)
