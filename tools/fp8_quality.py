"""What fp8 weights cost in quality: a model against its FP8 copy (tools.fp8_checkpoint), both
served by tandem's engine in the same process.

    python -m tools.fp8_quality --model DIR [--prompts 64] [--new-tokens 64] --out fp8.json

For each of --prompts prompts (a fixed list of instructions, the model's chat template applied)
both engines decode --new-tokens greedy tokens. Reported: the fraction of those tokens that equal
the reference's, position by position (after a first difference the two continuations usually
part), the prompts whose first token and whole continuation are equal, and the mean KL divergence
of the FP8 model's next-token distribution from the reference's, KL(ref || fp8) in nats, at
every position of the reference's continuation (teacher-forced: both models read the same
tokens). The same figures for the reference's dtype against float32 give the scale: what bf16
itself costs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from engine.attention import AttentionMetadata
from engine.fp8 import Fp8Scheme
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from tools.fp8_checkpoint import quantize_folder

_SUBJECTS = ["a lighthouse", "the moon", "bread", "a river", "winter", "a library", "bees",
             "a violin"]  # fmt: skip
_TASKS = ["Write a short poem about {}.", "Explain how {} works to a child.",
          "List three facts about {}.", "Tell a story that begins with {}.",
          "Describe {} in one paragraph.", "Why do people like {}?",
          "Write a haiku about {}.", "What would a scientist ask about {}?"]  # fmt: skip


def prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts (up to 64 distinct) as token ids."""
    texts = [task.format(s) for task in _TASKS for s in _SUBJECTS][:count]
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in texts
    ]
    return [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]


def next_token_logprobs(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the model's next-token logits at every position of `tokens` [n, vocab]: one
    prefill of the whole sequence in blocks of the engine's cache, outside its scheduler."""
    cache, block = engine.kv_cache, engine.config.block_size
    blocks = list(range(-(-len(tokens) // block)))
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [blocks], block)
    model = engine.runner.model
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), cache.kv_caches, meta)
    return F.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def measure(folder: Path, count: int, new_tokens: int, dtype: str) -> dict:
    """The FP8 copy against the model in `dtype`; and, for scale, the model in `dtype` against
    itself in float32 (what bf16 alone costs), both as agreement and KL."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = prompts(tokenizer, count)
    with tempfile.TemporaryDirectory() as fp8_dir:
        quantize_folder(folder, Path(fp8_dir), Fp8Scheme(128, 128))
        ref = _engine(folder, dtype)
        result = {"model": str(folder), "dtype": dtype, "prompts": len(ids),
                  "new_tokens": new_tokens,
                  "fp8_scheme": "e4m3, 128x128 block scales, every decoder projection"}  # fmt: skip
        result["fp8"] = compare(ref, _engine(Path(fp8_dir), dtype), ids, new_tokens)
        if dtype != "float32":
            result[f"{dtype}_vs_float32"] = compare(
                _engine(folder, "float32"), ref, ids, new_tokens
            )
    return result


def _engine(folder: Path, dtype: str) -> LLMEngine:
    return LLMEngine.build(EngineConfig(model=str(folder), dtype=dtype, kv_cache_gb=0.25))


def compare(ref: LLMEngine, other: LLMEngine, ids: list[list[int]], new_tokens: int) -> dict:
    """`other` against `ref`: greedy tokens equal position by position, continuations equal
    whole, and the mean KL(ref || other) over ref's continuation."""
    stop = StopConditions(max_tokens=new_tokens, ignore_eos=True)
    ours, theirs = (e.generate(ids, SamplingParams(), stop) for e in (ref, other))
    kls = []
    for prompt, out in zip(ids, ours, strict=True):
        seq = prompt + out[:-1]  # the positions that predict each of ref's tokens
        p, q = (next_token_logprobs(e, seq)[len(prompt) - 1 :] for e in (ref, other))
        kls.append(F.kl_div(q, p, log_target=True, reduction="none").sum(-1))
    pairs = list(zip(ours, theirs, strict=True))
    equal = sum(a == b for r, o in pairs for a, b in zip(r, o, strict=True))
    return {
        "token_agreement": equal / (len(ids) * new_tokens),
        "prompts_fully_equal": sum(r == o for r, o in pairs),
        "first_tokens_equal": sum(r[0] == o[0] for r, o in pairs),
        "mean_kl_nats": torch.cat(kls).mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="an unquantized HF folder")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="fp8-quality.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    result = measure(args.model, args.prompts, args.new_tokens, args.dtype)
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
