"""Speculative decoding through the served stack, with real processes (the bundled SmolLM2 on the
CPU, over tcp):
- a decode server speculating with n-gram lookup behind tandem's prefill and the router answers
  greedy completions with the tokens of one engine without speculation, its drafts counted and
  accepted in /metrics;
- a decode server speculating with a draft model (SmolLM2 drafting for itself) is refused by a
  prefill that does not send the draft's prompt KV: Hello fails naming what is missing, and the
  client's request fails with that message instead of decoding with a recomputed prompt;
- behind a prefill run with the same --speculative-config, which sends the draft's prompt KV
  after the model's, it answers with the same tokens, every proposal accepted, and the bytes
  committed are the model's and the draft's for every prompt token its prefix cache did not
  hold;
- the same decode server behind an aggregated router (it prefills itself, the draft too) answers
  with the same tokens, every proposal accepted;
- a tiny DeepSeek-V3 folder with an MTP layer (SmolLM2's tokenizer), prefill and decode both
  speculating with MTP: the tokens of one engine without speculation, the MTP layer's prompt
  KV sent with the model's;
- SmolLM2 with a random EAGLE-3 head on both: the same tokens, the head's prompt KV (computed
  by the prefill from the streams its forward kept) sent with the model's.
Afterwards no KV block stays allocated on any decode server.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
import torch
from transformers import AutoTokenizer

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from prefill.ticket import SpeculativeKv, kv_dtype_fields, layout_descriptor
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2
from tests.servers import (
    MODEL,
    counter,
    decode_pool_free,
    metrics_url,
    start_decode,
    start_prefill,
    start_router,
    stop,
)
from tests.tiny_folders import write_tiny_mla

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
PROMPTS = ["Repeat this code exactly:\n" + CODE + "Again:\n" + CODE[:12], "1, 2, 3, 4, 5,"]
MAX_TOKENS = 20
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
SELF_DRAFT = json.dumps({"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3})
DRAFT_KV = "draft_model:hnd:30x3x64:float32"  # SmolLM2's layers x KV heads x head dim, dtype
MODEL_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2's K and V, every layer, float32
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
MTP_KV = "mtp:mla-latent:1x1x40:float32"  # one layer's latent: kv_lora_rank 32 + rope dim 8
EAGLE3 = json.dumps({"method": "eagle3", "model": "random:eagle3-smollm2",
                     "num_speculative_tokens": 3})  # fmt: skip
EAGLE3_KV = "eagle3:hnd:1x3x64:float32"  # the head's one layer, SmolLM2's KV heads


@pytest.fixture(scope="module")
def stack():
    """An n-gram decode server behind a prefill and a router; a draft-model decode server
    behind a router to the same prefill, and behind an aggregated router."""
    ngram, ngram_address = start_decode("tcp", "float32", "--speculative-config", NGRAM)
    draft, draft_address = start_decode(
        "tcp", "float32", "--speculative-config", SELF_DRAFT, "--enable-prefix-caching"
    )
    prefill, prefill_url = start_prefill("tcp")
    drafting, drafting_url = start_prefill("tcp", 0, "--speculative-config", SELF_DRAFT)
    router, url = start_router([prefill_url], [ngram_address])
    refused, refused_url = start_router([prefill_url], [draft_address], "--no-decode-only-fallback")
    per_request = ("--per-request-spec-decode-metrics", "summary")
    sent, sent_url = start_router(
        [drafting_url], [draft_address], "--no-decode-only-fallback", *per_request
    )
    aggregated, aggregated_url = start_router([], [draft_address], "--aggregated", *per_request)
    yield {
        "ngram": (ngram_address, url),
        "draft": (draft_address, refused_url, aggregated_url),
        "draft_sent": (draft_address, sent_url),
        "prefill": prefill_url,
    }
    stop(aggregated, sent, refused, router, drafting, prefill, draft, ngram)


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """Greedy texts of one engine without speculation."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    engine = LLMEngine.build(EngineConfig(model=MODEL, dtype="float32", block_size=16))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    outputs = engine.generate(prompts, SamplingParams(), StopConditions(max_tokens=MAX_TOKENS))
    return [tokenizer.decode(out) for out in outputs]


def _complete(url: str, prompt: str, model: str = MODEL) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _texts(url: str, model: str = MODEL, every_draft_accepted: bool = False) -> list[str]:
    """Every prompt's greedy completion through the router at `url`; `every_draft_accepted`:
    and each reply's speculative decoding (the router's per-request metrics) says so."""
    texts = []
    for prompt in PROMPTS:
        reply = _complete(url, prompt, model)
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
        if every_draft_accepted:
            spec = reply.json()["metrics"]["speculative_decoding"]
            assert spec["num_draft_tokens"] > 0 and spec["draft_acceptance_rate"] == 1.0, spec
            assert spec["num_accepted_draft_tokens"] == spec["num_draft_tokens"], spec
            assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] > 0, spec
    return texts


def test_ngram_decode_through_the_stack_equals_one_engine(stack, reference):
    address, url = stack["ngram"]
    assert _texts(url) == reference
    metrics = metrics_url(address)
    drafted = counter(metrics, "tandem_decode_spec_draft_tokens_total")
    accepted = counter(metrics, "tandem_decode_spec_accepted_tokens_total")
    assert drafted > 0 and accepted > drafted / 3  # the repeated code is looked up
    assert counter(metrics, "tandem_decode_spec_accepted_tokens_per_pos_total") == accepted
    assert decode_pool_free(address) is not None


def _sender_layout(speculative_kv: str = "") -> layout_pb2.LayoutDescriptor:
    """A prefill of the bundled model in float32 writing over tcp, as prefill.server's."""
    return layout_descriptor(
        model_name=MODEL, num_layers=30, num_kv_heads=3, head_dim=64,
        **kv_dtype_fields(torch.float32, 1.0), block_size=16, layout="tandem-hnd",
        transport="tcp", speculative_kv=speculative_kv,
    )  # fmt: skip


def test_a_prefill_without_the_drafts_kv_is_refused_at_hello(stack):
    address, refused_url, _ = stack["draft"]
    with grpc.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Hello(decode_pb2.HelloRequest(sender_layout=_sender_layout()), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"needs '{DRAFT_KV}', sender writes 'none'" in e.value.details()
        # A sender that writes the draft's KV is let in.
        hello = decode_pb2.HelloRequest(sender_layout=_sender_layout(DRAFT_KV))
        assert stub.Hello(hello, timeout=5).decode_layout.speculative_kv == DRAFT_KV
    reply = _complete(refused_url, PROMPTS[1])
    assert reply.status_code == 503, reply.text
    message = reply.json()["error"]["message"]
    assert "speculative_kv" in message and DRAFT_KV in message, message
    assert decode_pool_free(address) is not None


def test_draft_model_decode_prefilling_itself_accepts_every_proposal(stack, reference):
    address, _, aggregated_url = stack["draft"]
    assert _texts(aggregated_url, every_draft_accepted=True) == reference
    metrics = metrics_url(address)
    drafted = counter(metrics, "tandem_decode_spec_draft_tokens_total")
    assert drafted > 0
    assert counter(metrics, "tandem_decode_spec_accepted_tokens_total") == drafted
    assert decode_pool_free(address) is not None


def _prompt_tokens() -> int:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    return sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)


def test_behind_a_prefill_that_sends_the_drafts_kv_every_proposal_is_accepted(stack, reference):
    address, sent_url = stack["draft_sent"]
    metrics = metrics_url(address)
    names = ("transfer_bytes", "spec_draft_tokens", "spec_accepted_tokens", "prefix_cache_hits")
    before = [counter(metrics, f"tandem_decode_{name}_total") for name in names]
    assert _texts(sent_url, every_draft_accepted=True) == reference
    sent, drafted, accepted, hits = (
        counter(metrics, f"tandem_decode_{name}_total") - value
        for name, value in zip(names, before, strict=True)
    )
    assert drafted > 0 and accepted == drafted
    # The decode server caches prefixes: the blocks of each prompt it prefilled itself before
    # (the aggregated test), the draft's KV with them, were not sent again; every proposal from
    # that KV is still accepted.
    assert hits > 0
    per_token = MODEL_BYTES_PER_TOKEN + SpeculativeKv.parse(DRAFT_KV).bytes_per_token
    assert sent == (_prompt_tokens() - hits) * per_token
    assert decode_pool_free(address) is not None


@pytest.fixture(scope="module")
def mtp_stack(tmp_path_factory):
    """A DeepSeek-V3 folder with an MTP layer: prefill and decode speculating with it, a router;
    and the greedy texts of one engine on it without speculation."""
    folder = str(write_tiny_mla(tmp_path_factory.mktemp("mla-mtp"), mtp=True))
    model = ("--model", folder, "--speculative-config", MTP)
    decode, address = start_decode("tcp", "float32", *model)
    prefill, prefill_url = start_prefill("tcp", 0, *model)
    router, url = start_router(
        [prefill_url], [address], "--model", folder, "--no-decode-only-fallback"
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = LLMEngine.build(EngineConfig(model=folder, dtype="float32", block_size=16))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    outputs = engine.generate(prompts, SamplingParams(), StopConditions(max_tokens=MAX_TOKENS))
    yield folder, address, url, [tokenizer.decode(out) for out in outputs]
    stop(router, prefill, decode)


def test_mtp_prefill_and_decode_equal_one_engine(mtp_stack):
    folder, address, url, expected = mtp_stack
    assert _texts(url, folder) == expected
    metrics = metrics_url(address)
    assert counter(metrics, "tandem_decode_spec_draft_tokens_total") > 0
    model_per_token = 3 * 1 * 40 * 4  # three layers' latent rows, float32
    per_token = model_per_token + SpeculativeKv.parse(MTP_KV).bytes_per_token
    sent = counter(metrics, "tandem_decode_transfer_bytes_total")
    assert sent == _prompt_tokens() * per_token
    assert decode_pool_free(address) is not None


def test_eagle3_prefill_and_decode_equal_one_engine(reference):
    model = ("--speculative-config", EAGLE3)
    decode, address = start_decode("tcp", "float32", *model)
    prefill, prefill_url = start_prefill("tcp", 0, *model)
    router, url = start_router([prefill_url], [address], "--no-decode-only-fallback")
    try:
        assert _texts(url) == reference
        metrics = metrics_url(address)
        assert counter(metrics, "tandem_decode_spec_draft_tokens_total") > 0
        per_token = MODEL_BYTES_PER_TOKEN + SpeculativeKv.parse(EAGLE3_KV).bytes_per_token
        sent = counter(metrics, "tandem_decode_transfer_bytes_total")
        assert sent == _prompt_tokens() * per_token
        assert decode_pool_free(address) is not None
    finally:
        stop(router, prefill, decode)
