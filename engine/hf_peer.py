"""The benchmark's peer: Hugging Face transformers `generate` on an engine's very own weights.

The engine's model config becomes a transformers config (Llama family, or DeepSeek-V3 for the
MLA/MoE family) and its parameters a transformers state dict: Hugging Face's checkpoint names
(engine.weights.hf_state_dict), except the routed experts, which transformers holds stacked in
memory under the same names and shapes as the engine does.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from engine.config import ModelConfig
from engine.deepseek_config import YarnRopeScaling
from engine.engine_config import DTYPES
from engine.llm_engine import LLMEngine
from engine.model import CausalLM
from engine.weights import hf_state_dict

_HF_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def decode_tok_s(engine: LLMEngine, batch: int, context: int, decode_tokens: int) -> float:
    """transformers `generate` (greedy, no EOS) on the engine's own weights: decode tok/s over
    the decode_tokens steps after the first token, timed from the host's receipt of the first
    new token to that of the last (a streamer sees each step's tokens as generate makes them)."""
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        """When each put() came: the prompt's, then each step's new tokens'."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    model = _hf_model(engine)
    device = engine.config.device
    prompt = torch.randint(0, engine.model_config.vocab_size, (batch, context), device=device)

    def run(new_tokens: int) -> list[float]:
        clock = TokenClock()
        with torch.inference_mode():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        return clock.times

    # Warm-up at full length: a first long generate runs several times slower than the next.
    run(decode_tokens + 1)
    times = run(decode_tokens + 1)
    assert len(times) == decode_tokens + 2, "one put() for the prompt, one per new token"
    return batch * decode_tokens / (times[-1] - times[1])


def _hf_model(engine: LLMEngine):
    """The transformers model of the engine's config, holding the engine's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = engine.model_config
    hf_config = AutoConfig.for_model(_HF_MODEL_TYPES[config.architecture], **_hf_fields(config))
    with torch.device(engine.config.device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=DTYPES[engine.config.dtype])
    loaded = model.load_state_dict(_in_memory_state_dict(engine.runner.model), strict=False)
    missing = [k for k in loaded.missing_keys if not _peer_only(k, config)]
    if missing or loaded.unexpected_keys:
        raise RuntimeError(
            f"weights differ: {missing} missing, {loaded.unexpected_keys} unexpected"
        )
    return model.eval()


def _peer_only(name: str, config: ModelConfig) -> bool:
    """Parameters transformers has and the engine need not: a tied model's lm_head (the
    embedding, loaded), and the correction bias of routers that do not use one (transformers'
    DeepSeek-V3 always routes with noaux_tc; the peer then routes by zeros: a throughput peer)."""
    if config.tie_word_embeddings and "lm_head" in name:
        return True
    return name.endswith("e_score_correction_bias") and config.moe.topk_method != "noaux_tc"


def _in_memory_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Checkpoint names, with the routed experts stacked as transformers holds them."""
    state = {k: v for k, v in hf_state_dict(model).items() if ".mlp.experts." not in k}
    state.update((k, v) for k, v in model.named_parameters() if ".mlp.experts." in k)
    return state


def _hf_fields(c: ModelConfig) -> dict:
    fields = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_theta,
    )
    if isinstance(c.rope_scaling, YarnRopeScaling):
        fields["rope_scaling"] = {"rope_type": "yarn", **asdict(c.rope_scaling)}
    elif c.rope_scaling is not None:
        fields["rope_scaling"] = {"rope_type": "llama3", **asdict(c.rope_scaling)}
    if c.mla is not None and c.moe is not None:
        fields.update(asdict(c.mla))
        moe = asdict(c.moe)
        moe.pop("scoring_func")  # each transformers model has its own
        if c.architecture != "DeepseekV2ForCausalLM":  # V3's routes by noaux_tc only
            moe.pop("topk_method")
        fields.update(moe)
    return fields
