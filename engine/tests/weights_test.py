import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.model import CausalLM
from engine.tests.tiny_hf import PagedRunner, hf_logits, hf_model, load, rel_err
from engine.weights import hf_state_dict, init_random_weights, load_state_dict, load_weights

TOKENS = [5, 17, 3, 42, 8, 91, 23, 4, 60, 11]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf_model("llama").save_pretrained(folder)
    return folder


def _rewrite(folder, change):
    """Edits the single-file checkpoint's tensor dict in place."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_tied_checkpoint_matches_hf(tmp_path):
    hf = hf_model("qwen3", tie=True)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: saved once, as the embedding
    ours = load(tmp_path)
    assert ours.lm_head is None
    assert rel_err(PagedRunner(ours).step({0: TOKENS})[0], hf_logits(hf, TOKENS)) < 1e-4


def test_loads_in_bfloat16(llama_folder):
    ours = load(llama_folder, torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    ref = hf_logits(hf_model("llama"), TOKENS)
    assert rel_err(PagedRunner(ours).step({0: TOKENS})[0], ref) < 5e-2


def test_stale_copies_a_checkpoint_may_carry_are_ignored(tmp_path):
    hf = hf_model("llama", tie=True)
    hf.save_pretrained(tmp_path)

    def add_stale(tensors):
        tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _rewrite(tmp_path, add_stale)
    ours = load(tmp_path)
    assert rel_err(PagedRunner(ours).step({0: TOKENS})[0], hf_logits(hf, TOKENS)) < 1e-4


def test_missing_tensor_is_named(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        load(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra"):
        load(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    _rewrite(
        tmp_path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(16, 64)})
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load(tmp_path)


def test_qk_norm_model_refuses_a_checkpoint_without_qk_norm(llama_folder):
    qwen3 = dataclasses.replace(ModelConfig.from_hf_folder(llama_folder), qk_norm=True)
    with torch.device("meta"):
        model = CausalLM(qwen3)
    with pytest.raises(ValueError, match=r"missing tensors: .*q_norm\.weight"):
        load_weights(model, llama_folder, torch.float32, "cpu")


def test_refuses_materialized_model_bad_dtype_and_empty_folder(tmp_path, llama_folder):
    config = ModelConfig.from_hf_folder(llama_folder)
    with pytest.raises(ValueError, match="meta device"):
        load_weights(CausalLM(config), llama_folder, torch.float32, "cpu")
    with torch.device("meta"):
        model = CausalLM(config)
    with pytest.raises(ValueError, match="dtype"):
        load_weights(model, llama_folder, torch.int8, "cpu")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_weights(model, tmp_path, torch.float32, "cpu")


def _random_model(seed, preset="tiny"):
    with torch.device("meta"):
        model = CausalLM(ModelConfig.preset(preset))
    init_random_weights(model, seed, torch.float32, "cpu")
    return model


def test_random_weights_are_deterministic_and_finite():
    a, b, c = _random_model(7), _random_model(7), _random_model(8)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert bool((pa == 1).all()), name
        else:
            assert not torch.equal(pa, pc), name
            assert abs(float(pa.std()) - 0.02) < 0.005, name
    logits = PagedRunner(a).step({0: list(range(20)), 1: [3, 1, 4]})
    assert all(bool(out.isfinite().all()) for out in logits.values())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_state_dict_round_trip_through_hugging_face_names(kind, tmp_path):
    hf = hf_model(kind)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_folder(tmp_path)
    with torch.device("meta"):
        model = CausalLM(config)
    load_state_dict(model, hf.state_dict(), torch.float32, "cpu")
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    assert rel_err(PagedRunner(model).step({0: tokens})[0], hf_logits(hf, tokens)) < 1e-5

    exported = hf_state_dict(model)
    assert exported.keys() == {k for k in hf.state_dict() if "rotary" not in k}
    for name, tensor in exported.items():
        assert torch.equal(tensor, hf.state_dict()[name]), name
    # Views, not copies: the fused projection's rows are the exported q/k/v tensors.
    q = exported["model.layers.0.self_attn.q_proj.weight"]
    assert q.data_ptr() == model.model.layers[0].self_attn.qkv_proj.weight.data_ptr()


def test_dummy_load_format_draws_the_folders_shape_and_never_reads_its_weights(
    tmp_path, llama_folder
):
    from engine.engine_config import EngineConfig
    from engine.model_loader import load_model

    (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
    config = EngineConfig(model=str(tmp_path), dtype="float32", load_format="dummy")
    shape, model = load_model(config)
    assert shape == ModelConfig.from_hf_folder(llama_folder)
    again = load_model(config)[1].state_dict()
    # The folder with weights, loaded dummy: the same draws, not the checkpoint's tensors.
    ignored = load_model(dataclasses.replace(config, model=str(llama_folder)))[1].state_dict()
    checkpoint = load(llama_folder, torch.float32).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again[name]) and torch.equal(tensor, ignored[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(tensor, checkpoint[name]), name
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(dataclasses.replace(config, load_format="auto"))
    with pytest.raises(ValueError, match="load_format: 'npz' is not one of auto, dummy"):
        dataclasses.replace(config, load_format="npz")
