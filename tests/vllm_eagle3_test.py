"""tandem's EAGLE-3 proposer against stock vLLM's (the CPU build) on the same random checkpoints:
a Llama target of eight layers (head_dim 64, which vLLM's CPU attention takes) and an EAGLE-3
head as trainers write it (a 60-token draft vocabulary of 96, mapped through d2t). Greedy, one
prompt, 24 tokens: vLLM's tokens equal tandem's, and at every step both propose, the same three
drafts (tandem proposes fewer only where max_tokens leaves no room for them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.speculative import SpeculativeConfig
from engine.tests.tiny_hf import randomize, write_eagle3_head

SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=192, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)  # fmt: skip
PROMPT = [1, 17, 42, 9, 33, 7, 81, 5, 60, 12, 3, 44, 70, 21, 8, 90, 31, 2, 55, 64]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(**SHAPE, num_hidden_layers=8, bos_token_id=1, eos_token_id=2)
    randomize(transformers.LlamaForCausalLM(llama).eval()).save_pretrained(target)
    head = tmp_path_factory.mktemp("eagle3")
    config = dict(SHAPE, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                  num_hidden_layers=1, draft_vocab_size=60)  # fmt: skip
    write_eagle3_head(head, config)
    return target, head


def test_tandems_drafts_are_vllms(folders, tmp_path):
    target, head = folders
    spec = SpeculativeConfig("eagle3", 3, model=str(head))
    engine = LLMEngine.build(EngineConfig(
        model=str(target), dtype="float32", kv_cache_gb=0.01, max_num_seqs=1,
        speculative_config=spec,
    ))  # fmt: skip
    ours, propose = [], engine.proposer.propose

    def recorded(seqs, rooms):
        drafts = propose(seqs, rooms)
        ours.extend(drafts)
        return drafts

    engine.proposer.propose = recorded
    stop = StopConditions(MAX_TOKENS, ignore_eos=True)
    tokens = engine.generate([PROMPT], SamplingParams(), stop)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_RPC_BASE_PATH=str(tmp_path))
    if "TEST_TMPDIR" in os.environ:  # vLLM caches under $HOME, read-only in Bazel's sandbox
        env["VLLM_CACHE_ROOT"] = os.path.join(os.environ["TEST_TMPDIR"], "vllm")
    run = subprocess.run(
        [sys.executable, "-m", "tests.vllm_eagle3_drafts", str(target), str(head),
         str(MAX_TOKENS), json.dumps(PROMPT)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    vllm = json.loads(run.stdout.strip().splitlines()[-1])
    assert vllm["tokens"] == tokens[0]
    assert len(ours) <= len(vllm["drafts"])
    assert sum(len(d) == 3 for d in ours) >= MAX_TOKENS - 4
    for i, drafts in enumerate(ours):
        assert drafts == vllm["drafts"][i][: len(drafts)], i
