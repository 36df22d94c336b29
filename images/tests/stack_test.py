"""The CPU images run as a router + prefill + decode stack (podman, host network) and serve a
completion whose greedy text equals Hugging Face's on the same model."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from images.tests.podman import Podman

MODEL = Path(os.path.realpath("tools/smollm2-135m-instruct/config.json")).parent
ENGINE = ["--model", "/model", "--dtype", "float32", "--block-size", "16", "--kv-cache-gb", "0.1"]
PROMPT = "The capital of France is"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def router():
    podman = Podman()
    try:
        images = {s: podman.load(f"images/{s}_cpu.tar") for s in ("decode", "prefill", "router")}
        mounts = {str(MODEL): "/model"}
        decode = podman.start(images["decode"], [*ENGINE, "--grpc-port", "0"],
                              r"serving gRPC on [\d.]+:(\d+)", mounts)  # fmt: skip
        prefill = podman.start(images["prefill"], [*ENGINE, "--port", "0"],
                               r"serving on (http://[\d.:]+)", mounts)  # fmt: skip
        router = podman.start(
            images["router"],
            ["--model", "/model", "--port", "0", "--prefill", prefill.group(1),
             "--decode", f"127.0.0.1:{decode.group(1)}"],
            r"serving on (http://[\d.:]+)",
            mounts,
        )  # fmt: skip
        yield router.group(1)
    finally:
        podman.cleanup()


def _hf_greedy() -> str:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_completion_through_the_containers(router):
    response = httpx.post(
        f"{router}/v1/completions",
        json={"model": "/model", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == NEW_TOKENS
    assert body["choices"][0]["text"] == _hf_greedy()
