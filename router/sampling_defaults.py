"""The sampling a request gets for the fields it leaves unset, as vLLM's server gives it
(`--generation-config`): the model's own recommendation, from its generation_config.json
("auto", the default), or none ("vllm"); then OpenAI's defaults (temperature 1, no top-p,
top-k or min-p filtering, no penalty). So a client that sends no temperature samples, at the
model's temperature where it names one, and greedy decoding is asked for with temperature 0.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.sampling_ranges import checked_sampling_value

RECOMMENDED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty")  # fmt: skip
"""The generation_config.json fields vLLM takes as defaults (its max_new_tokens aside)."""
OPENAI = {"temperature": 1.0}
"""What is left unset otherwise is the engine's neutral default (no filtering, no penalty)."""


def sampling_defaults(model: str | Path, source: str = "auto") -> dict[str, float | int]:
    """The defaults of a router serving the Hugging Face folder `model`. `source`: "auto" (the
    folder's generation_config.json), "vllm" (OpenAI's only) or another folder holding a
    generation_config.json. ValueError naming the file and field for a value out of range."""
    if source == "vllm":
        return dict(OPENAI)
    folder = Path(model if source == "auto" else source)
    if source != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"--generation-config: {source} holds no generation_config.json")
    path = folder / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    defaults = dict(OPENAI)
    for name in RECOMMENDED:
        value = config.get(name)
        if value is None:
            continue
        try:  # as a request's value is checked (top_k -1: no limit; 20.0 an int)
            defaults[name] = checked_sampling_value(name, value)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return defaults
