"""An MLA model served with stock vLLM as its prefill: `//tools:serve --prefill vllm` on a tiny
random DeepSeek-V3 (float32, SmolLM2's tokenizer), as a user runs it. vLLM's CPU build prefills
(its CPU_MLA backend, 16-token blocks) and TandemConnector writes each layer's latent (one
576-wide row a token: the decode server's "mla-latent") into the decode server's 64-token
blocks; tandem's decode server decodes from it. Greedy chat and completions through the router,
one at a time and concurrent, must equal vLLM alone, and the decode server must have had
exactly the prompts' latent committed.

NOTE: vLLM 0.32's CPU build turns chunked prefill and prefix caching off for MLA models (its
CpuPlatform: "MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching
to be disabled", unless the CPU has AMX), so neither happens here: prefill/tests/vllm_mla_test.py
sends a prompt in chunks through the worker side instead.
NOTE: the model has YaRN RoPE, as DeepSeek-V3 does. With default RoPE, vLLM's CPU rotary kernel
(_C.rotary_embedding, 0.32) takes each token's stride from the tensors' second-to-last dimension,
right for [tokens, heads * dim] but not for MLA's [tokens, heads, 64] q_pe and k_pe views: vLLM
alone then answers other than transformers (and tandem) from the second prompt token on. YaRN
goes through DeepseekScalingRotaryEmbedding's torch code instead.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from prefill.vllm_launch import READY, free_port, vllm_args
from tests.servers import counter
from tests.tiny_folders import write_vllm_mla
from tests.vllm_servers import stop
from tools.launch import start

LAYERS, LATENT = 3, 512 + 64
KV_BYTES_PER_TOKEN = LAYERS * LATENT * 4  # float32
NEW_TOKENS = 12
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = {
    "short": "The capital of France is",  # inside one vLLM block
    "blocks": "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting "
    "the steps as his father had taught him: one hundred and twelve, worn smooth in the middle.",
    "long": " ".join(["At the top he trimmed the wick, polished the great lens until it threw "
                      "back the last of the daylight, and wrote the weather in a ledger."] * 5),
}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_vllm_mla(tmp_path_factory.mktemp("deepseek-v3-tiny")))


def _start_vllm_alone(model: str):
    """vLLM without the connector, as tests/vllm_servers.py starts it for the bundled model."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    if "TEST_TMPDIR" in os.environ:  # vLLM caches under $HOME, read-only in Bazel's sandbox
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(os.environ["TEST_TMPDIR"], "vllm")
    port = free_port("127.0.0.1")
    args = vllm_args(model, "127.0.0.1", port, "float32", None, "--max-model-len", "512")
    proc, _ = start(args, READY, timeout=300)
    return proc, f"http://127.0.0.1:{port}/v1"


def _answers(client: openai.OpenAI) -> dict:
    """Greedy chat text and completions (text, prompt tokens) of PROMPTS, sent together."""
    served = client.models.list().data[0].id

    def complete(prompt: str) -> tuple[str, int]:
        reply = client.completions.create(
            model=served, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
        )
        return reply.choices[0].text, reply.usage.prompt_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = dict(zip(PROMPTS, pool.map(complete, PROMPTS.values()), strict=True))
    chat = client.chat.completions.create(
        model=served, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0
    )
    outs["chat"] = chat.choices[0].message.content, chat.usage.prompt_tokens
    return outs


@pytest.fixture(scope="module")
def reference(model) -> dict:
    proc, url = _start_vllm_alone(model)
    try:
        return _answers(openai.OpenAI(base_url=url, api_key="unused", max_retries=0))
    finally:
        stop(proc)


def test_vllm_prefill_and_tandem_decode_of_an_mla_model_equal_vllm_alone(model, reference):
    proc, m = start(["tools.serve", "--prefill", "vllm", "--model", model, "--port", "0",
                     "--kv-cache-gb", "1"],
                    r"tandem ready: (http://\S+) \(decode metrics: (\S+)\)",
                    timeout=600)  # fmt: skip
    try:
        url, metrics = m.group(1), m.group(2)
        before = counter(metrics, "tandem_decode_transfer_bytes_total")
        outs = _answers(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
        assert outs == reference
        assert outs["long"][1] > 2 * 64  # over three decode blocks (and ten of vLLM's)
        # The latent moved: exactly the prompts' rows, every layer, were committed.
        sent = sum(tokens for _, tokens in outs.values())
        assert counter(metrics, "tandem_decode_transfer_bytes_total") - before == (
            sent * KV_BYTES_PER_TOKEN
        )
    finally:
        stop(proc)
