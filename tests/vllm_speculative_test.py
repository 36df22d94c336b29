"""Stock vLLM (the CPU build) as the prefill of a speculating decode server, as a user runs it:
`//tools:serve --prefill vllm --speculative-config JSON`. vLLM runs the same speculative config,
and TandemConnector sends its proposer's layers of each prompt after the model's (vLLM writes
them in the same step, before the connector's wait_for_save):
- SmolLM2 drafting for itself (draft_model): greedy completions equal one tandem engine without
  speculation; every proposal is accepted (the draft's prompt KV is vLLM's draft model's, the
  target's is vLLM's model's: the same model, so the draft agrees with the target); the bytes
  committed are the model's and the draft's for every prompt token;
- a tiny DeepSeek-V3 with one MTP layer (mtp): greedy completions equal one tandem engine
  without speculation, drafts are made, and the MTP layer's latent of every prompt token was
  committed with the model's;
- a Llama with an EAGLE-3 head (eagle3): the same, the head's layer's K and V committed.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from transformers import AutoTokenizer

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from tests.servers import MODEL, counter
from tests.tiny_folders import write_eagle3, write_vllm_mla
from tests.vllm_servers import stop
from tools.launch import start

PROMPTS = ["The capital of France is", "def fib(n):\n    return n if n < 2 else", "1, 2, 3, 4,"]
MAX_TOKENS = 12
SMOLLM2_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # every layer's K and V, float32
LATENT_BYTES_PER_TOKEN = (512 + 64) * 4  # one layer's latent row, float32


def _serve(model: str, spec: dict):
    os.environ.update(HF_HUB_OFFLINE="1")
    if "TEST_TMPDIR" in os.environ:  # vLLM caches under $HOME, read-only in Bazel's sandbox
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(os.environ["TEST_TMPDIR"], "vllm")
    proc, m = start(["tools.serve", "--prefill", "vllm", "--model", model, "--port", "0",
                     "--kv-cache-gb", "1", "--speculative-config", json.dumps(spec)],
                    r"tandem ready: (http://\S+) \(decode metrics: (\S+)\)",
                    timeout=600)  # fmt: skip
    return proc, m.group(1), m.group(2)


def _texts(url: str, model: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    return texts


def _one_engine(model: str) -> tuple[list[str], int]:
    """Greedy texts of one tandem engine without speculation; the prompts' tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = LLMEngine.build(EngineConfig(model=model, dtype="float32", block_size=16))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    outputs = engine.generate(prompts, SamplingParams(), StopConditions(max_tokens=MAX_TOKENS))
    return [tokenizer.decode(out) for out in outputs], sum(map(len, prompts))


def test_vllm_drafting_for_itself_sends_the_drafts_kv_and_every_proposal_is_accepted():
    expected, prompt_tokens = _one_engine(MODEL)
    spec = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3}
    proc, url, metrics = _serve(MODEL, spec)
    try:
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        assert _texts(url, served) == expected
        drafted = counter(metrics, "tandem_decode_spec_draft_tokens_total")
        assert drafted > 0
        assert counter(metrics, "tandem_decode_spec_accepted_tokens_total") == drafted
        sent = counter(metrics, "tandem_decode_transfer_bytes_total")
        assert sent == prompt_tokens * 2 * SMOLLM2_BYTES_PER_TOKEN  # the model's and the draft's
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    return str(write_vllm_mla(tmp_path_factory.mktemp("deepseek-v3-mtp"), mtp=True))


def test_vllm_with_mtp_sends_the_mtp_layers_latent(mtp_model):
    expected, prompt_tokens = _one_engine(mtp_model)
    proc, url, metrics = _serve(mtp_model, {"method": "mtp", "num_speculative_tokens": 2})
    try:
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        assert _texts(url, served) == expected
        assert counter(metrics, "tandem_decode_spec_draft_tokens_total") > 0
        sent = counter(metrics, "tandem_decode_transfer_bytes_total")
        assert sent == prompt_tokens * (3 + 1) * LATENT_BYTES_PER_TOKEN  # 3 layers + MTP's
    finally:
        stop(proc)


def test_vllm_with_an_eagle3_head_sends_its_layers_kv(tmp_path_factory):
    """An EAGLE-3 head (engine/eagle.py): vLLM's drafter writes its one layer's K and V of each
    prompt position in the prefill's step; the decode server's head reads them."""
    target, head = write_eagle3(tmp_path_factory.mktemp("eagle3"))
    expected, prompt_tokens = _one_engine(str(target))
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    proc, url, metrics = _serve(str(target), spec)
    try:
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        assert _texts(url, served) == expected
        assert counter(metrics, "tandem_decode_spec_draft_tokens_total") > 0
        sent = counter(metrics, "tandem_decode_transfer_bytes_total")
        assert sent == prompt_tokens * (8 + 1) * 2 * 64 * 4  # 8 layers + the head's: K, V fp32
    finally:
        stop(proc)
