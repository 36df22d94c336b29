"""The benchmark tool runs end to end (CPU, tiny model) and writes its JSON: it cannot rot; its
roofline counts the bytes it says it counts."""

import gzip
import json
import subprocess
import sys

import pytest

from engine import bench, roofline
from engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from engine.llm_engine import EngineConfig, LLMEngine
from engine.tests.tiny_hf import hf_deepseek_v2


def test_bench_writes_results_for_every_point_and_the_peer(tmp_path):
    """Every case's figures, the peer's, and (--profile-steps) a profile of further steps with
    its trace beside the JSON."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "engine.bench", "--model", "random:tiny", "--dtype", "float32"]
    cmd += ["--batch-sizes", "1,3", "--context-lens", "20", "--decode-tokens", "4"]
    cmd += ["--peer", "hf", "--profile-steps", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    points = [(r["system"], r["batch"], r["context"]) for r in results]
    assert points == [("tandem", 1, 20), ("hf", 1, 20), ("tandem", 3, 20), ("hf", 3, 20)]
    assert all(r["decode_tok_s"] > 0 for r in results)
    assert "decode tok/s" in done.stdout
    for r in results[::2]:  # tandem's
        profile = r["profile"]
        assert (profile["steps"], profile["tokens"]) == (2, 2 * r["batch"])
        assert 0 < profile["busy_us_per_step"] <= profile["wall_us_per_step"]
        assert any(k["name"].startswith("aten::") for k in profile["kernels"])
        trace = tmp_path / f"bench-tandem-b{r['batch']}-c20.trace.json.gz"
        assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert "us/step" in done.stdout


def test_bench_runs_a_labelled_speculative_variant_at_its_simulated_acceptance(tmp_path):
    out = tmp_path / "bench.json"
    spec = '{"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 3, '
    spec += '"acceptance_curve": "all-accepted-depth-4"}'
    cmd = [sys.executable, "-m", "engine.bench", "--model", "random:tiny", "--dtype", "float32"]
    cmd += ["--batch-sizes", "2", "--context-lens", "20", "--decode-tokens", "8"]
    cmd += ["--benchmark-mode", "--variant", f"sim:speculative_config={spec}", "--out", str(out)]
    cmd += ["--temperature", "1.0", "--top-p", "0.9"]  # sampled requests speculate too
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert (report["temperature"], report["top_p"]) == (1.0, 0.9)
    plain, sim = report["results"]
    assert (plain["system"], sim["system"]) == ("tandem", "sim")
    assert plain["acceptance_length"] is None
    assert sim["acceptance_length"] == 4.0  # every draft accepted: k + 1 tokens a step
    assert sim["tpot_ms"] > 0 and plain["tpot_ms"] > 0


def test_bench_compares_tensor_parallel_sizes_in_one_run(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "engine.bench", "--model", "random:tiny-kv4", "--dtype"]
    cmd += ["float32", "--batch-sizes", "2", "--context-lens", "20", "--decode-tokens", "4"]
    # Two engines with ranks, one after the other: the first's must be stopped for the second's.
    cmd += ["--variant", "tp2:tensor_parallel_size=2", "--variant", "tp4:tensor_parallel_size=4"]
    done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["system"] for r in results] == ["tandem", "tp2", "tp4"]
    assert all(r["decode_tok_s"] > 0 for r in results)


def test_variant_labels_and_json_values():
    base = EngineConfig(model="random:tiny", benchmark_mode=True)
    label, config = bench.variant_config(base, "model=random:tiny-fp8,kv_cache_dtype=fp8")
    assert label == "model=random:tiny-fp8,kv_cache_dtype=fp8"
    assert (config.model, config.kv_cache_dtype) == ("random:tiny-fp8", "fp8")
    label, config = bench.variant_config(
        base, 'ngram:seed=3,speculative_config={"method": "ngram", "num_speculative_tokens": 2}'
    )
    assert label == "ngram" and config.seed == 3
    assert config.speculative_config.num_speculative_tokens == 2
    _, config = bench.variant_config(base, "sync:async_scheduling=false")  # a bool | None
    assert config.async_scheduling is False
    with pytest.raises(ValueError, match="'colour' is not an EngineConfig field"):
        bench.variant_config(base, "x:colour=red")


@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m"])  # untied, tied
def test_roofline_counts_the_bytes_of_the_model_and_of_a_step(preset):
    engine = LLMEngine.build(
        EngineConfig(model=f"random:{preset}", dtype="float32", kv_cache_gb=0.01, max_model_len=64)
    )
    c = engine.model_config
    assert not c.attention_bias and not c.qk_norm  # the count below has neither
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    mlp = 3 * c.intermediate_size * c.hidden_size
    layer = attention + mlp + 2 * c.hidden_size  # and the two norms
    table = c.vocab_size * c.hidden_size
    lm_head = 0 if c.tie_word_embeddings else table
    params = c.num_layers * layer + table + lm_head + c.hidden_size
    assert roofline.parameter_bytes(engine) == 4 * params
    # A step gathers one embedding row per sequence; a tied lm_head reads the whole table.
    read = params - (0 if c.tie_word_embeddings else table) + 3 * c.hidden_size
    assert roofline.weight_bytes_per_step(engine, batch=3) == 4 * read


@pytest.mark.parametrize("model", ["random:deepseek-tiny", "deepseek-v2-folder"])
def test_the_deepseek_peer_runs_on_the_engines_weights(model, tmp_path):
    """transformers' DeepSeek-V3 (or V2, for a V2 checkpoint) gets every engine weight (the
    stacked experts, V3's correction bias) or the run fails: hf_peer refuses a state dict that
    leaves one out."""
    if model == "deepseek-v2-folder":
        model = str(tmp_path / "v2")
        hf_deepseek_v2().save_pretrained(model)
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "engine.bench", "--model", model]
    cmd += ["--dtype", "float32", "--batch-sizes", "2", "--context-lens", "12"]
    cmd += ["--decode-tokens", "3", "--peer", "hf", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["system"] for r in results] == ["tandem", "hf"]


@pytest.mark.parametrize("batch", [1, 5])
def test_moe_roofline_counts_the_experts_a_step_chooses(batch):
    """Of each MoE layer's routed experts a step reads those its tokens choose: exactly k at
    batch 1; the expected union of `batch` uniform choices beyond."""
    engine = LLMEngine.build(
        EngineConfig(model="random:deepseek-tiny", dtype="float32", kv_cache_gb=0.01)
    )
    c, moe = engine.model_config, engine.model_config.moe
    expert = 3 * moe.moe_intermediate_size * c.hidden_size
    sparse = c.num_layers - moe.first_k_dense_replace
    table = c.vocab_size * c.hidden_size
    all_read = roofline.parameter_bytes(engine) // 4 - table + batch * c.hidden_size
    hit = 2 if batch == 1 else 8 * (1 - (1 - 2 / 8) ** batch)
    expected = all_read - sparse * (8 - hit) * expert
    assert roofline.weight_bytes_per_step(engine, batch) == pytest.approx(4 * expected, abs=4)


def test_moe_roofline_counts_fp8_experts_at_their_bytes():
    """fp8 experts are read at a byte a weight, plus their float32 scales (a row's per block of
    32 columns)."""
    engine = LLMEngine.build(
        EngineConfig(model="random:deepseek-tiny-fp8", dtype="float32", kv_cache_gb=0.01)
    )
    c, moe = engine.model_config, engine.model_config.moe
    size, hidden = moe.moe_intermediate_size, c.hidden_size
    scales = 2 * size * -(-hidden // 32) + hidden * -(-size // 32)
    expert = 3 * size * hidden + 4 * scales
    sparse = c.num_layers - moe.first_k_dense_replace
    one, two = (roofline.weight_bytes_per_step(engine, batch) for batch in (1, 2))
    unread = [sparse * (8 - hit) * expert for hit in (2, 8 * (1 - (1 - 2 / 8) ** 2))]
    assert two - one == pytest.approx(4 * hidden + unread[0] - unread[1], abs=2)


def test_a_json_schema_constrains_every_sequence_through_the_timed_steps():
    """--json-schema's path; SmolLM2's tokenizer cut to the tiny model's 256 tokens (its specials
    and single characters) will do, as any tokenizer does to time the masks."""
    engine = LLMEngine.build(EngineConfig(model="random:tiny", dtype="float32", kv_cache_gb=0.01))
    compiler = GrammarCompiler("tools/smollm2-135m-instruct", engine.model_config.vocab_size)
    text = {"type": "string", "minLength": 64}  # longer than the run: no sequence completes
    schema = {"type": "object", "properties": {"text": text}, "required": ["text"]}
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), True))
    result = bench.bench_engine(engine, 3, 20, 4, float("nan"), grammar)
    assert result.decode_tok_s > 0
