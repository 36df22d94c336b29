"""FP8 weights (engine.fp8) on the CPU: block quantization, FP8 checkpoints against the same
model dequantized in transformers, the random fp8 preset, and the configs refused."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import fp8
from engine.config import ModelConfig
from engine.deepseek import DeepseekForCausalLM
from engine.fp8 import FP8_DTYPE, FP8_MAX, Fp8Scheme
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model import CausalLM
from engine.model_loader import load_model
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.tests.tiny_hf import VOCAB, PagedRunner, hf_deepseek, hf_logits, hf_model, rel_err
from engine.weights import hf_state_dict, init_random_weights, load_state_dict, load_weights
from tools.fp8_checkpoint import quantize_folder

# 48x48 blocks on the tiny Llama (hidden 64, q 64 / k and v 32 rows, intermediate 112): partial
# blocks in both dimensions, and fused parts not starting on a block boundary.
SCHEMES = {
    "block48": Fp8Scheme(48, 48),
    "block32": Fp8Scheme(32, 32),
    "block128": Fp8Scheme(128, 128),
    "tensor": None,
}


def _scheme(name):
    return SCHEMES[name] if SCHEMES[name] is not None else Fp8Scheme(None, None)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantize_rounds_each_element_to_e4m3_within_its_block(name):
    """q = w / scale rounded to e4m3 (3 mantissa bits: within 2^-4 of |q|, or 2^-10 among the
    subnormals), each block's largest magnitude at FP8_MAX."""
    scheme = _scheme(name)
    w = torch.randn(100, 130, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = fp8.quantize(w, scheme)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    rows = scheme.expand_scale(scale, w.shape[0])
    block_k = scheme.block_k or w.shape[1]
    exact = w / rows.repeat_interleave(block_k, dim=1)[:, : w.shape[1]]  # w / its block's scale
    bound = torch.maximum(exact.abs() * 2**-4, torch.full_like(exact, 2**-10))
    assert ((q.float() - exact).abs() <= bound * (1 + 1e-6)).all()
    assert q.float().abs().max().item() == FP8_MAX
    assert rows.shape == (w.shape[0], scheme.k_blocks(w.shape[1]))


def _fp8_folder(tmp_path, scheme_name, hf=None):
    """A tiny random model (Llama unless `hf` is given) saved, then written into tmp_path as an
    FP8 checkpoint (tools.fp8_checkpoint), and transformers' model holding the dequantized
    weights (float32): the reference."""
    scheme = _scheme(scheme_name)
    hf = hf_model("llama", seed=3) if hf is None else hf
    hf.save_pretrained(tmp_path / "src")
    quantize_folder(tmp_path / "src", tmp_path, scheme)
    state = load_file(tmp_path / "model.safetensors")
    dequantized = {
        name: scheme.matrix(q, scheme.expand_scale(scale, q.shape[0])).dense(torch.float32)
        for name, q in state.items()
        if (scale := state.get(name.removesuffix("weight") + scheme.scale_name)) is not None
    }
    unexpected = hf.load_state_dict(_stacked(hf, dequantized), strict=False).unexpected_keys
    assert not unexpected, unexpected
    return hf


def _stacked(hf, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> transformers' in-memory ones: each layer's routed experts stacked
    (gate_up_proj [experts, 2I, H], down_proj [experts, H, I]), as transformers holds them."""
    params = dict(hf.named_parameters())
    out = {}
    for name, tensor in state.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = tensor
            continue
        expert, part, _ = tail.split(".")
        stack = f"{head}.mlp.experts.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
        slab = out.setdefault(stack, params[stack].detach().clone())[int(expert)]
        rows = slab.shape[0] // 2
        {"gate_proj": slab[:rows], "up_proj": slab[rows:], "down_proj": slab}[part].copy_(tensor)
    return out


def _load(folder, dtype=torch.float32) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf_folder(folder))
    load_weights(model, folder, dtype, "cpu")
    return model


@pytest.mark.parametrize("name", list(SCHEMES))
def test_fp8_checkpoint_matches_its_dequantized_model(tmp_path, name):
    """Logits of the fp8 checkpoint (weights kept fp8, dequantized per block at each product)
    against transformers holding the same dequantized weights: float32 within 1e-5 (the same
    products, summed in another order); bf16 within 2e-2 (each dequantized weight rounded to
    bf16's 8 bits, and activations)."""
    hf = _fp8_folder(tmp_path, name)
    model = _load(tmp_path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32  # not quantized
    tokens = torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = hf_logits(hf, tokens)
    assert rel_err(PagedRunner(model).step({0: tokens})[0], reference) < 1e-5
    bf16 = _load(tmp_path, torch.bfloat16)
    assert rel_err(PagedRunner(bf16).step({0: tokens})[0], reference) < 2e-2


@pytest.mark.parametrize("name", ["block32", "tensor"])
def test_deepseek_fp8_checkpoint_matches_its_dequantized_model(tmp_path, name):
    """DeepSeek-V3 as its FP8 checkpoints are: every projection fp8 (attention's, the dense and
    shared MLPs', each routed expert's), the router not. 32x32 blocks: the latent projection's
    40 rows start at row 48 of the fused q_a + latent projection, mid-block. Logits against
    transformers on the dequantized weights (float32, 1e-5), prefill and a decode step (the
    absorbed form, through the dequantized kv_b_proj)."""
    hf = _fp8_folder(tmp_path, name, hf_deepseek(48, seed=4))
    with torch.device("meta"):
        model = DeepseekForCausalLM(ModelConfig.from_hf_folder(tmp_path))
    load_weights(model, tmp_path, torch.float32, "cpu")
    layer = model.model.layers[1]
    assert layer.mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    assert layer.self_attn.kv_b_proj.weight.dtype == FP8_DTYPE
    assert layer.mlp.gate.weight.dtype == torch.float32
    tokens = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = hf_logits(hf, tokens)
    runner = PagedRunner(model)
    assert rel_err(runner.step({0: tokens[:11]})[0], reference[:11]) < 1e-5
    assert rel_err(runner.step({0: tokens[11:]})[0], reference[11:]) < 1e-5


def test_hf_state_dict_gives_the_checkpoints_tensors_back(tmp_path):
    """The inverse of loading, scales back in the checkpoint's blocks: a second model loaded
    from it holds the same bits."""
    _fp8_folder(tmp_path, "block48")
    model = _load(tmp_path)
    state = hf_state_dict(model)
    saved = load_file(tmp_path / "model.safetensors")
    assert state.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    with torch.device("meta"):
        again = CausalLM(model.config)
    load_state_dict(again, state, torch.float32, "cpu")
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_a_missing_scale_is_named(tmp_path):
    _fp8_folder(tmp_path, "block48")
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj"):
        _load(tmp_path)


def _expert_down(model):
    return fp8.expert(model.model.layers[1].mlp.experts.matrix("down_proj"), 3)


@pytest.mark.parametrize(
    "preset, matrix",
    [("tiny", lambda m: m.model.layers[1].mlp.down_proj.matrix), ("deepseek-tiny", _expert_down)],
)
def test_random_fp8_preset_generates_and_frees_every_block(preset, matrix):
    """random:<preset>-fp8: the random model's projections (and routed experts) quantized, so
    its weights are within e4m3's rounding of random:<preset>'s, drawn from the same seed."""
    config = dict(dtype="float32", block_size=4, kv_cache_gb=1e-3)
    engine = LLMEngine.build(EngineConfig(model=f"random:{preset}-fp8", **config))
    dense_engine = LLMEngine.build(EngineConfig(model=f"random:{preset}", **config))
    ours, theirs = matrix(engine.runner.model), matrix(dense_engine.runner.model)
    assert ours.weight.dtype == FP8_DTYPE
    assert rel_err(ours.dense(torch.float32), theirs) < 0.05
    stop = StopConditions(max_tokens=4, ignore_eos=True)
    outputs = engine.generate([[1, 5, 9], [1, 7, 3, 8, 200]], SamplingParams(), stop)
    assert [len(out) for out in outputs] == [4, 4]
    assert engine.pool.num_free == engine.pool.num_total


def test_fp8_kv_cache_stays_within_e4m3_rounding_of_float32_kv():
    """The same model and steps (a chunked prompt, then 8 decode steps) with its K and V stored
    as e4m3: each value within 2^-4 (6.25%) of itself, ~1.8% RMS for uniform mantissas, and
    logits about as far: within 5e-2 of a float32 cache's (measured 1.2-2.6% over 4 prompts);
    greedy tokens equal (so measured on those prompts too)."""
    model = _load_tiny()
    prompt = torch.randint(3, VOCAB, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    outputs = []
    for kv_dtype in (torch.float32, FP8_DTYPE):
        runner = PagedRunner(model, kv_dtype=kv_dtype)
        assert runner.cache.kv_caches[0][0].dtype == kv_dtype
        logits = [runner.step({0: prompt[:6]})[0], runner.step({0: prompt[6:]})[0]]
        for _ in range(8):
            logits.append(runner.step({0: [int(logits[-1][-1].argmax())]})[0])
        outputs.append(logits)
    for fp8_step, exact in zip(*outputs, strict=True):
        assert rel_err(fp8_step, exact) < 5e-2
        assert torch.equal(fp8_step[-1].argmax(), exact[-1].argmax())


def test_fp8_latent_cache_stays_within_e4m3_rounding_of_float32_latents():
    """DeepSeek's MLA with its latent rows stored as e4m3 (scale 1.0, as vLLM's fp8 MLA caches
    other than FlashMLA's hold them), fed the same tokens as a float32 plane: a chunked prompt,
    then 8 decode steps (the absorbed form). Each stored value loses up to 2^-3 of itself
    (rounded toward zero; 5.2% RMS on these latents), and the latent is both key and value:
    logits within 20% of the float32 plane's at every step and 5% at the median (measured over
    12 prompts: at most 13.7%, median 3.4%)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(ModelConfig.preset("deepseek-tiny"))
    init_random_weights(model, 0, torch.float32, "cpu")
    errors = []
    for seed in range(4):
        prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(seed))
        exact, fp8 = (PagedRunner(model, kv_dtype=dtype) for dtype in (torch.float32, FP8_DTYPE))
        assert fp8.cache.kv_caches[0][0].dtype == FP8_DTYPE
        tokens = prompt[:6].tolist()
        for step in range(10):  # the prompt in two chunks, then the float32 plane's greedy tokens
            logits = exact.step({0: tokens})[0]
            errors.append(rel_err(fp8.step({0: tokens})[0], logits))
            tokens = prompt[6:].tolist() if step == 0 else [int(logits[-1].argmax())]
    assert max(errors) < 0.2 and sorted(errors)[len(errors) // 2] < 5e-2, errors


def test_fp8_kv_is_stored_as_vllms_cpu_kernels_store_it():
    """Saturated at +-448 (not NaN), rounded toward zero in the normal and subnormal ranges, an
    input zero unsigned: the bytes vLLM's CPU cache write gives (prefill/tests/vllm_layouts_test
    compares the two on vLLM's own kernel)."""
    from engine.attention import to_cache

    values = [1000.0, -1000.0, 3.0, 2.97, -2.97, 0.0155, -0.0, 1e-9, -1e-9, 2**-9 * 1.5]
    stored = to_cache(torch.tensor(values), FP8_DTYPE)
    assert stored.float().tolist() == [FP8_MAX, -FP8_MAX, 3.0, 2.75, -2.75, 0.013671875,
                                       0.0, 0.0, 0.0, 2**-9]  # fmt: skip
    assert stored.view(torch.uint8)[6:9].tolist() == [0, 0, 0x80]  # -0.0 in: +0; -1e-9: -0


def _load_tiny() -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(ModelConfig.preset("tiny"))
    init_random_weights(model, 0, torch.float32, "cpu")
    return model


def test_the_dequantized_kv_b_follows_its_weights():
    """MLA keeps kv_b_proj's fp8 matrix dequantized (the absorbed attention reads its slices
    every step) and dequantizes it again when weights are copied in: into the same buffer,
    which CUDA graphs captured before the copy keep reading."""
    _, model = load_model(EngineConfig(model="random:deepseek-tiny-fp8"))
    attention = model.model.layers[0].self_attn
    first = attention._kv_b(torch.float32)
    assert attention._kv_b(torch.float32) is first
    before = first.clone()
    torch.testing.assert_close(first, attention.kv_b_proj.matrix.dense(torch.float32))
    with torch.no_grad():
        attention.kv_b_proj.weight_scale.mul_(2)
    assert attention._kv_b(torch.float32) is first
    torch.testing.assert_close(first, 2 * before)


def test_fp8_experts_in_blocks_the_cuda_kernels_cannot_step_by_are_refused(tmp_path):
    """On CUDA the experts' K steps must divide the scale blocks in multiples of 16; refused at
    start-up naming the block size, before any weight is read (the folder has none)."""
    hf = hf_deepseek(48, seed=4)
    config = {**hf.config.to_dict(), "architectures": [type(hf).__name__]}
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [24, 24]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scale blocks of 24 columns; the CUDA experts kernels"):
        load_model(EngineConfig(model=str(tmp_path), device="cuda"))


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8_e5m2' is not one of auto, fp8"):
        EngineConfig(model="random:tiny", kv_cache_dtype="fp8_e5m2")


def _llama_dict(**quantization):
    return {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
        "intermediate_size": 112, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "quantization_config": {"quant_method": "fp8", **quantization},
    }  # fmt: skip


@pytest.mark.parametrize(
    "quantization, named",
    [
        (dict(quant_method="gptq"), "quant_method 'gptq'"),
        (dict(fmt="e5m2"), "fmt 'e5m2'"),
        (dict(activation_scheme="static"), "activation_scheme 'static'"),
        (dict(modules_to_not_convert=["lm_head", "model.layers.0.mlp"]), "modules_to_not_convert"),
        (dict(weight_block_size=[128]), "weight_block_size"),
        (dict(weight_block_size=[128, 0]), "weight_block_size"),
    ],
)
def test_unsupported_quantization_is_refused_by_field(quantization, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_dict(_llama_dict(**quantization))


def test_block_and_per_tensor_schemes_parse():
    block = ModelConfig.from_hf_dict(_llama_dict(weight_block_size=[128, 128]))
    assert block.fp8 == Fp8Scheme(128, 128) and block.fp8.scale_name == "weight_scale_inv"
    tensor = ModelConfig.from_hf_dict(_llama_dict(modules_to_not_convert=["lm_head"]))
    assert tensor.fp8 == Fp8Scheme(None, None) and tensor.fp8.scale_name == "weight_scale"
