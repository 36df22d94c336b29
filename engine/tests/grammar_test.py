"""Structured outputs through the whole engine, on the real bundled model (SmolLM2-135M-Instruct,
CPU, float32: xgrammar needs a real tokenizer): greedy output under a JSON Schema parses and has
the schema's keys and types; under a regex it is one of the options, and an unconstrained
neighbour in the same batch gets the very tokens it gets alone (with async scheduling, which
constrained steps turn off); a decode-side sequence continues from a first token the grammar
allows; a spec that does not compile fails with xgrammar's message. Plus the pure parts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engine.grammar import (
    GrammarCompiler,
    GrammarKind,
    GrammarSpec,
    allows,
    choice_grammar,
    structured_outputs_spec,
)
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import FinishReason, StopConditions

torch.set_num_threads(1)

MODEL = Path("tools/smollm2-135m-instruct")  # Bazel data: //tools:smollm2
GREEDY = SamplingParams()
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(
        model=str(MODEL), dtype="float32", block_size=16, kv_cache_gb=0.1, async_scheduling=True
    )
    return LLMEngine.build(config)


def _chat(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished:
        engine.step()
    assert not engine.sequences and engine.pool.num_free == engine.pool.num_total


def test_json_schema_output_parses_with_the_schemas_keys_and_types(engine, tokenizer):
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), compact_whitespace=True)
    prompt = _chat(tokenizer, "Describe a person, with a name and an age, as JSON.")
    seq = engine.add_request(
        "json", prompt, GREEDY, StopConditions(max_tokens=40), engine.grammars.compile(spec)
    )
    _run(engine)
    assert seq.finish_reason is FinishReason.STOP  # the grammar ended, on EOS
    assert seq.output_ids[-1] in engine.model_config.eos_token_ids
    text = tokenizer.decode(seq.output_ids[:-1])
    value = json.loads(text)
    assert set(value) == {"name", "age"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 16
    assert type(value["age"]) is int
    assert " " not in text.replace(value["name"], "")  # compact: no whitespace outside strings


def test_a_regex_gives_one_option_and_leaves_its_neighbour_alone(engine, tokenizer):
    stop = StopConditions(max_tokens=12)
    question, other = _chat(tokenizer, "Is the sky blue?"), _chat(tokenizer, "Name a fruit.")
    [alone] = engine.generate([other], GREEDY, stop)
    assert engine.async_scheduling  # on its own, steps went ahead
    grammar = engine.grammars.compile(GrammarSpec(GrammarKind.REGEX, "(yes|no)"))
    constrained = engine.add_request("regex", question, GREEDY, stop, grammar)
    neighbour = engine.add_request("free", other, GREEDY, stop)
    while engine.has_unfinished:
        engine.step()
        # A mask needs the token before it: no step goes ahead while a grammar runs.
        assert not engine.has_step_in_flight or constrained.finished
    _run(engine)
    assert tokenizer.decode(constrained.output_ids[:-1]) in ("yes", "no")
    assert constrained.finish_reason is FinishReason.STOP
    assert neighbour.output_ids == alone


def test_a_prefilled_sequence_continues_from_an_allowed_first_token(engine, tokenizer):
    """The decode server's path: the first token comes from the prefill, is checked against the
    grammar without advancing it, then appended (and accepted) on admission."""
    grammar = engine.grammars.compile(GrammarSpec(GrammarKind.GRAMMAR, choice_grammar(["ab"])))
    prompt = _chat(tokenizer, "Say ab.")
    seq = engine.new_sequence("p", prompt, GREEDY, StopConditions(max_tokens=5), grammar)
    [b] = tokenizer.encode("b")
    [a] = tokenizer.encode("a")
    assert not allows(seq.grammar, b)
    assert allows(seq.grammar, a) and allows(seq.grammar, a)  # left as it was
    # No prompt KV was written: the decoded token is then the grammar's only choice anyway.
    blocks = engine.pool.allocate(-(-len(prompt) // engine.config.block_size))
    assert engine.add_prefilled(seq, blocks, a)
    _run(engine)
    assert seq.output_ids == [a, b, engine.model_config.eos_token_ids[0]]


def test_a_spec_that_does_not_compile_fails_with_xgrammars_message(engine):
    bad = [
        (GrammarKind.JSON_SCHEMA, '{"type": "objekt"}', 'Unsupported type "objekt"'),
        (GrammarKind.JSON_SCHEMA, "{bad", "Failed to parse JSON"),
        (GrammarKind.REGEX, "(abc", "parenthesis is not closed"),
        (GrammarKind.GRAMMAR, 'start ::= "a"', 'root rule with name "root" is not found'),
    ]
    for kind, text, message in bad:
        with pytest.raises(ValueError, match=rf"^{kind.value}: does not compile: .*{message}"):
            engine.grammars.compile(GrammarSpec(kind, text))


def test_a_model_without_a_tokenizer_cannot_compile(tmp_path):
    for folder in ("random:tiny", str(tmp_path)):
        compiler = GrammarCompiler(folder, vocab_size=256)
        with pytest.raises(ValueError, match=r"^needs the model.s tokenizer"):
            compiler.compile(GrammarSpec(GrammarKind.JSON_OBJECT))


def test_specs_and_choices_are_checked_and_escaped():
    with pytest.raises(ValueError, match="json_schema: the text must not be empty"):
        GrammarSpec(GrammarKind.JSON_SCHEMA)
    with pytest.raises(ValueError, match="json_object: the text must be empty"):
        GrammarSpec(GrammarKind.JSON_OBJECT, "{}")
    assert choice_grammar(['a"b', "c\\d\n", "\x01"]) == r'root ::= "a\"b" | "c\\d\n" | "\u0001"'
    for bad in ([], ["a", 1]):
        with pytest.raises(ValueError, match="choice: must be a non-empty list of strings"):
            choice_grammar(bad)


@pytest.mark.parametrize(
    ("given", "spec"),
    [
        (None, None),
        ({"json": {"type": "object"}}, GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object"}')),
        ({"json": '{"type":"integer"}', "disable_any_whitespace": True},
         GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"integer"}', compact_whitespace=True)),
        ({"json_object": True, "regex": None}, GrammarSpec(GrammarKind.JSON_OBJECT)),
        ({"regex": "[0-9]+"}, GrammarSpec(GrammarKind.REGEX, "[0-9]+")),
        ({"grammar": 'root ::= "a"'}, GrammarSpec(GrammarKind.GRAMMAR, 'root ::= "a"')),
        ({"choice": ["yes", 'n"o']}, GrammarSpec(GrammarKind.GRAMMAR, r'root ::= "yes" | "n\"o"')),
    ],
)  # fmt: skip
def test_structured_outputs_shapes_vllm_accepts(given, spec):
    assert structured_outputs_spec(given) == spec


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("json", "must be an object"),
        ({}, "give exactly one of json, json_object, regex, grammar, choice (got 0)"),
        ({"json": {}, "regex": "a"}, "give exactly one of json, json_object, regex, grammar, "
         "choice (got 2)"),
        ({"structural_tag": "{}", "whitespace_pattern": " "},
         "unsupported key(s): structural_tag, whitespace_pattern"),
        ({"json": 5}, "json: must be a JSON Schema, as an object or as its text"),
        ({"json_object": False}, "json_object: False; must be true when given"),
        ({"regex": 5}, "regex: must be a string"),
        ({"regex": ""}, "regex: the text must not be empty"),
        ({"choice": []}, "choice: must be a non-empty list of strings"),
        ({"choice": "yes"}, "choice: must be a non-empty list of strings"),
        ({"regex": "a", "disable_any_whitespace": "yes"},
         "disable_any_whitespace: 'yes' is not a boolean"),
    ],
)  # fmt: skip
def test_structured_outputs_shapes_refused(given, message):
    with pytest.raises(ValueError) as err:
        structured_outputs_spec(given)
    assert str(err.value) == message
