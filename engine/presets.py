"""Named model shapes, for random weights (`random:<name>`) and benchmarks."""

import dataclasses

from engine.config import Llama3RopeScaling, ModelConfig
from engine.deepseek_config import MlaConfig, MoeConfig, YarnRopeScaling
from engine.fp8 import Fp8Scheme

PRESETS: dict[str, ModelConfig] = {
    # A few layers, small dims, GQA: fast enough for CPU tests.
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rope_scaling=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        max_position_embeddings=1024,
        eos_token_ids=(2,),
        bos_token_id=1,
    ),
    # meta-llama/Llama-3.1-8B-Instruct.
    "llama3-8b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        max_position_embeddings=131072,
        eos_token_ids=(128001, 128008, 128009),
        bos_token_id=128000,
    ),
    # Qwen/Qwen3-8B.
    "qwen3-8b": ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
        max_position_embeddings=40960,
        eos_token_ids=(151645, 151643),
        bos_token_id=151643,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct.
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rope_scaling=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=False,
        max_position_embeddings=8192,
        eos_token_ids=(2,),
        bos_token_id=1,
    ),
}

# Draft models for Llama-3-8B (speculative decoding; its vocabulary): meta-llama/Llama-3.2-1B's
# shape, and one Llama-3-8B decoder layer with its lm_head, what an EAGLE-style head or an MTP
# layer reads a step.
PRESETS["llama3.2-1b"] = dataclasses.replace(
    PRESETS["llama3-8b"],
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    head_dim=64,
    tie_word_embeddings=True,
    rope_scaling=Llama3RopeScaling(
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)
PRESETS["llama3-8b-1l"] = dataclasses.replace(PRESETS["llama3-8b"], num_layers=1)

# Tensor-parallel tests: SmolLM2's vocabulary (its tokenizer), 4 KV heads of 8 query heads, so
# that TP 2 and 4 split every dimension; an lm_head of its own (random tied embeddings mostly
# repeat the last token).
PRESETS["tiny-kv4"] = dataclasses.replace(
    PRESETS["smollm2-135m"],
    tie_word_embeddings=False,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    max_position_embeddings=2048,
)

# FP8 checkpoints' scheme (DeepSeek-V3, Qwen3 FP8): e4m3 weights, a scale per 128x128 block, the
# decoder's projections quantized from the random bf16 weights (engine.weights), lm_head not.
# tiny-fp8's 48x48 blocks give every matrix a partial block, and fused parts that do not start
# on a block boundary (k's 32 rows after q's 64).
PRESETS["llama3-8b-fp8"] = dataclasses.replace(PRESETS["llama3-8b"], fp8=Fp8Scheme(128, 128))
PRESETS["tiny-fp8"] = dataclasses.replace(PRESETS["tiny"], fp8=Fp8Scheme(48, 48))
# tiny with eight layers, whose streams entering layers 2, 4 and 5 an EAGLE-3 head of its shape
# (random:eagle3-tiny) reads.
PRESETS["tiny-8l"] = dataclasses.replace(PRESETS["tiny"], num_layers=8)
# 32x32 blocks (powers of two, as real checkpoints' 128): the one-row GEMV on CUDA steps by them.
PRESETS["tiny-fp8-b32"] = dataclasses.replace(PRESETS["tiny"], fp8=Fp8Scheme(32, 32))
# tiny-kv4 in fp8 with 64x64 blocks: TP 2 leaves each rank whole blocks, TP 4 does not (one
# KV head of 32 rows a rank).
PRESETS["tiny-kv4-fp8"] = dataclasses.replace(PRESETS["tiny-kv4"], fp8=Fp8Scheme(64, 64))

# A DeepSeek-V3-shaped model for CPU tests: one dense layer, then MoE layers of 8 routed experts
# (top-2 from the best group of 2) and a shared one; MLA with a q bottleneck; YaRN RoPE.
PRESETS["deepseek-tiny"] = ModelConfig(
    architecture="DeepseekV3ForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=4,
    head_dim=8,
    rope_theta=10000.0,
    rope_scaling=YarnRopeScaling(
        factor=4.0,
        original_max_position_embeddings=256,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    qk_norm=False,
    max_position_embeddings=1024,
    eos_token_ids=(2,),
    bos_token_id=1,
    mla=MlaConfig(
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
    ),
    moe=MoeConfig(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
    ),
)


def _deepseek_shape(
    architecture: str,
    layers: int,
    hidden: int,
    heads: int,
    dense_width: int,
    mla: MlaConfig,
    moe: MoeConfig,
    **rest,
) -> ModelConfig:
    """A DeepSeek-V3-family shape: num_kv_heads = heads (MLA), RoPE over qk_rope_head_dim."""
    return ModelConfig(
        architecture=architecture,
        hidden_size=hidden,
        intermediate_size=dense_width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=mla.qk_rope_head_dim,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        mla=mla,
        moe=moe,
        **rest,
    )


# deepseek-ai/DeepSeek-V2-Lite (15.7B total, 2.4B active): softmax scoring, greedy top-6 of 64
# experts, never renormalized, two shared, no q bottleneck.
PRESETS["deepseek-v2-lite"] = _deepseek_shape(
    "DeepseekV2ForCausalLM",
    layers=27,
    hidden=2048,
    heads=16,
    dense_width=10944,
    mla=MlaConfig(
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
    ),
    moe=MoeConfig(
        n_routed_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
    ),
    vocab_size=102400,
    rope_theta=10000.0,
    rope_scaling=YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    eos_token_ids=(100001,),
    bos_token_id=100000,
)

# deepseek-ai/DeepSeek-V3's layer shapes, 4 layers instead of 61 (one dense, three MoE: one GPU
# holds them in bf16; each MoE layer is 22.5 GB of experts).
PRESETS["deepseek-v3-4l"] = _deepseek_shape(
    "DeepseekV3ForCausalLM",
    layers=4,
    hidden=7168,
    heads=128,
    dense_width=18432,
    mla=MlaConfig(
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
    ),
    moe=MoeConfig(
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
    ),
    vocab_size=129280,
    rope_theta=10000.0,
    rope_scaling=YarnRopeScaling(
        factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    ),
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    eos_token_ids=(1,),
    bos_token_id=0,
)

# zai-org/GLM-5's MLA and MoE shapes, 4 layers instead of 78 (one dense, three MoE), as the
# DeepSeek-V3 architecture: GLM-5's sparse-attention indexer (DSA) is not modelled, so its
# attention here is dense MLA over the whole context.
PRESETS["glm5-4l"] = _deepseek_shape(
    "DeepseekV3ForCausalLM",
    layers=4,
    hidden=6144,
    heads=64,
    dense_width=12288,
    mla=MlaConfig(
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        rope_interleave=True,
    ),
    moe=MoeConfig(
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
    ),
    vocab_size=154880,
    rope_theta=1000000.0,
    rope_scaling=None,
    rms_norm_eps=1e-5,
    max_position_embeddings=202752,
    eos_token_ids=(154820, 154827, 154829),
    bos_token_id=0,
)

# DeepSeek-V3 and GLM-5 carry one multi-token-prediction layer (num_nextn_predict_layers); so do
# the shapes above (and deepseek-tiny, for tests), and deepseek-v2-lite-mtp, V2-Lite's shape with
# one added (V2-Lite has none).
for _name in ("deepseek-tiny", "deepseek-v3-4l", "glm5-4l"):
    PRESETS[_name] = dataclasses.replace(PRESETS[_name], num_mtp_layers=1)
PRESETS["deepseek-v2-lite-mtp"] = dataclasses.replace(PRESETS["deepseek-v2-lite"], num_mtp_layers=1)

# deepseek-tiny's projections and routed experts in fp8 (32x32 blocks: partial blocks in the
# 40-row latent projection and the fused q_a + latent rows), for CPU tests.
PRESETS["deepseek-tiny-fp8"] = dataclasses.replace(PRESETS["deepseek-tiny"], fp8=Fp8Scheme(32, 32))
# DeepSeek-V2-Lite's shape with its projections and routed experts in fp8, 128x128 blocks as
# DeepSeek-V3's and GLM-5's checkpoints ship them (the router, embeddings and lm_head not), for
# GPU benches beside the bf16 preset.
PRESETS["deepseek-v2-lite-fp8"] = dataclasses.replace(
    PRESETS["deepseek-v2-lite"], fp8=Fp8Scheme(128, 128)
)

# Llama-3-8B's KV shape (32 layers of 8 KV heads of 128, 128 KiB a token in bf16) on small
# matrices: what a handover costs in descriptors, posts and RPCs, without the 8B's compute
# (CPU handover benches).
PRESETS["llama3-8b-kv"] = dataclasses.replace(
    PRESETS["llama3-8b"], vocab_size=4096, hidden_size=256, intermediate_size=512, num_heads=8,
    eos_token_ids=(2,), bos_token_id=1,
)  # fmt: skip
