"""The defaults of unset sampling fields (router/sampling_defaults.py), read as vLLM's server
reads them: the model's generation_config.json ("auto"), OpenAI's alone ("vllm"), or another
folder's; a value out of range refused naming the file."""

import json

import pytest

from router.sampling_defaults import OPENAI, sampling_defaults


def _folder(tmp_path, name: str, config: dict | None):
    folder = tmp_path / name
    folder.mkdir()
    if config is not None:
        (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_the_models_recommendation_then_openais(tmp_path):
    recommended = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
                   "eos_token_id": [1, 2], "max_new_tokens": 100}  # fmt: skip
    model = _folder(tmp_path, "model", recommended)
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults(model, "vllm") == OPENAI == {"temperature": 1.0}
    other = _folder(tmp_path, "other", {"repetition_penalty": 1.1, "top_k": -1})
    expected = {"temperature": 1.0, "repetition_penalty": 1.1, "top_k": 0}
    assert sampling_defaults(model, str(other)) == expected
    whole = sampling_defaults(_folder(tmp_path, "float", {"top_k": 20.0}))  # as a request's
    assert whole["top_k"] == 20 and type(whole["top_k"]) is int
    assert sampling_defaults(_folder(tmp_path, "none", None)) == OPENAI
    assert sampling_defaults(_folder(tmp_path, "eos", {"eos_token_id": 2})) == OPENAI


def test_a_bad_value_or_folder_is_refused_naming_it(tmp_path):
    model = _folder(tmp_path, "model", {"temperature": 7})
    with pytest.raises(ValueError, match=r"generation_config.json: temperature: 7 is not in"):
        sampling_defaults(model)
    with pytest.raises(ValueError, match="--generation-config: /nowhere holds no"):
        sampling_defaults(model, "/nowhere")
    broken = _folder(tmp_path, "broken", None)
    (broken / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"generation_config\.json: Expecting"):
        sampling_defaults(broken)
