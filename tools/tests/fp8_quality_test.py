"""tools.fp8_checkpoint writes an FP8 checkpoint tandem serves; tools.fp8_quality measures it
against its source (the bundled SmolLM2, a few short prompts: the tool runs end to end)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine.fp8 import FP8_DTYPE, Fp8Scheme
from engine.tests.tiny_hf import hf_model
from tools import fp8_quality
from tools.fp8_checkpoint import quantize_folder

SMOLLM2 = Path("tools/smollm2-135m-instruct")  # Bazel data: //tools:smollm2


def test_the_checkpoint_quantizes_every_projection_and_nothing_else(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf_model("llama").save_pretrained(src)
    (src / "tokenizer.json").write_text("{}")  # copied as it is
    assert quantize_folder(src, dst, Fp8Scheme(48, 48)) == 2 * 7  # layers x projections
    state = load_file(dst / "model.safetensors")
    assert state["model.layers.1.mlp.down_proj.weight"].dtype == FP8_DTYPE
    assert state["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (2, 3)  # 64 x 112
    assert state["lm_head.weight"].dtype == state["model.norm.weight"].dtype != FP8_DTYPE
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [48, 48]
    assert (dst / "tokenizer.json").read_text() == "{}"
    with pytest.raises(ValueError, match="quantized already"):
        quantize_folder(dst, tmp_path / "again", Fp8Scheme(48, 48))


def test_an_engine_against_itself_agrees_fully_with_no_divergence():
    engine = fp8_quality._engine(SMOLLM2, "float32")
    ids = fp8_quality.prompts(fp8_quality.AutoTokenizer.from_pretrained(SMOLLM2), 2)
    same = fp8_quality.compare(engine, engine, ids, 4)
    assert same == {"token_agreement": 1.0, "prompts_fully_equal": 2, "first_tokens_equal": 2,
                    "mean_kl_nats": 0.0}  # fmt: skip


def test_the_quality_tool_writes_its_figures(tmp_path):
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, "-m", "tools.fp8_quality", "--model", str(SMOLLM2), "--prompts", "2",
           "--new-tokens", "4", "--dtype", "float32", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    fp8 = json.loads(out.read_text())["fp8"]
    assert 0.0 <= fp8["token_agreement"] <= 1.0 and fp8["prompts_fully_equal"] <= 2
    assert 0.0 < fp8["mean_kl_nats"] < 0.5  # rounded weights: some divergence, not a broken model
