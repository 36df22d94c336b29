"""The benchmark tool runs end to end (CPU, tiny model) and writes its JSON: it cannot rot."""

import json
import subprocess
import sys


def test_bench_writes_results_for_every_point_and_the_peer(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "engine.bench", "--model", "random:tiny", "--dtype", "float32"]
    cmd += ["--batch-sizes", "1,3", "--context-lens", "20", "--decode-tokens", "4"]
    cmd += ["--peer", "hf", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    points = [(r["system"], r["batch"], r["context"]) for r in results]
    assert points == [("tandem", 1, 20), ("hf", 1, 20), ("tandem", 3, 20), ("hf", 3, 20)]
    assert all(r["decode_tok_s"] > 0 for r in results)
    assert "decode tok/s" in done.stdout
