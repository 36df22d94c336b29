"""Stock vLLM (the CPU build, offline, in this process) generating greedily with an EAGLE-3 head,
printing the tokens and every proposal its drafter made, as one JSON line:

    python -m tests.vllm_eagle3_drafts TARGET HEAD MAX_TOKENS PROMPT_IDS_JSON

vLLM exposes no drafts, so its proposer's `propose` is wrapped here (vLLM's engine core runs in
this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    target, head, max_tokens, prompt = sys.argv[1:]
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    drafts: list[list[int]] = []
    propose = SpecDecodeBaseProposer.propose

    def recorded(self, *args, **kwargs):
        out = propose(self, *args, **kwargs)
        drafts.extend(out.tolist())
        return out

    SpecDecodeBaseProposer.propose = recorded
    llm = LLM(
        model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
        enforce_eager=True, max_num_seqs=1,
        speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=int(max_tokens), temperature=0, ignore_eos=True, detokenize=False
    )
    out = llm.generate([TokensPrompt(prompt_token_ids=json.loads(prompt))], params)
    print(json.dumps({"tokens": list(out[0].outputs[0].token_ids), "drafts": drafts}), flush=True)


if __name__ == "__main__":
    main()
