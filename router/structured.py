"""Structured outputs: the request fields that constrain the generated text, checked and turned
into one tandem.v1.StructuredOutput.

  response_format {"type": "json_object" | "json_schema"}         (OpenAI)
  structured_outputs {json | json_object | regex | choice | grammar, disable_any_whitespace}
  guided_json | guided_regex | guided_choice | guided_grammar      (vLLM's older names)

A choice list becomes an EBNF grammar, as vLLM builds it. Every grammar is parsed once here
(engine/grammar.py `check`: xgrammar without a tokenizer), so a bad one is a 400 before any
backend is touched; the decode server and the prefill compile it against the vocabulary.
The prefill gets it in vLLM's own `structured_outputs` field (`prefill_fields`), which tandem's
prefill server and vLLM both honour, so the first token obeys it too.
"""

from __future__ import annotations

import json

from proto.tandem.v1 import decode_pb2
from router.errors import RequestError

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar")  # fmt: skip
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_output(body: dict) -> decode_pb2.StructuredOutput | None:
    """The constraint `body` asks for, or None; RequestError (400) names what is wrong."""
    asked = {name: body[name] for name in FIELDS if name in body}
    response_format = asked.pop("response_format", {"type": "text"})
    spec = _from_response_format(response_format)
    if "structured_outputs" in asked:
        value = asked.pop("structured_outputs")
        if not isinstance(value, dict):
            raise RequestError(400, "structured_outputs: must be an object", "structured_outputs")
        spec = _one(spec, value, "structured_outputs")
    for name, value in asked.items():  # guided_*
        spec = _one(spec, {name.removeprefix("guided_"): value}, name)
    return None if spec is None else _checked(spec)


def json_schema(schema: dict, param: str) -> decode_pb2.StructuredOutput:
    """A constraint to `schema` (a forced tool call's), checked as a client's would be."""
    return _checked({"json": schema, "param": param})


def prefill_fields(structured: decode_pb2.StructuredOutput) -> dict:
    """The same constraint in vLLM's completions field."""
    kind = structured.WhichOneof("kind")
    spec = {"json": structured.json_schema} if kind == "json_schema" else {
        kind: getattr(structured, kind)}  # fmt: skip
    if structured.compact_whitespace:
        spec["disable_any_whitespace"] = True
    return {"structured_outputs": spec}


def _from_response_format(value) -> dict | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = value.get("json_schema")
        schema = schema.get("schema") if isinstance(schema, dict) else None
        if not isinstance(schema, dict | bool):
            raise RequestError(400, "response_format.json_schema.schema: a JSON Schema object "
                               "is required", "response_format")  # fmt: skip
        return {"json": schema}
    raise RequestError(400, f"response_format: type {kind!r} is not one of text, json_object, "
                       "json_schema", "response_format")  # fmt: skip


def _one(spec: dict | None, value: dict, param: str) -> dict:
    kinds = [k for k in _KINDS if value.get(k) not in (None, False)]
    unknown = sorted(set(value) - {*_KINDS, "disable_any_whitespace"})
    if unknown:
        raise RequestError(400, f"{param}: unknown field(s) {', '.join(unknown)}", param)
    if spec is not None or len(kinds) != 1:
        raise RequestError(400, f"{param}: give exactly one constraint (json, json_object, regex, "
                           "choice or grammar), in one field", param)  # fmt: skip
    return {k: value[k] for k in (kinds[0], "disable_any_whitespace") if k in value} | {
        "param": param}  # fmt: skip


def _checked(spec: dict) -> decode_pb2.StructuredOutput:
    param = spec.pop("param", "response_format")
    compact = spec.pop("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise RequestError(400, f"{param}: disable_any_whitespace must be true or false", param)
    ((kind, value),) = spec.items()
    out = decode_pb2.StructuredOutput(compact_whitespace=compact)
    if kind == "json_object":
        if value is not True:
            raise RequestError(400, f"{param}: json_object must be true", param)
        out.json_object = True
        return out
    if kind == "choice":
        from engine import grammar  # NOTE: here, not at the top: it imports torch (seconds)

        try:
            kind, value = "grammar", grammar.choice_grammar(value)
        except ValueError as e:
            raise RequestError(400, f"{param}: {e}", param) from None
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise RequestError(400, f"{param}: the JSON Schema is not JSON", param) from None
        kind, value = "json_schema", json.dumps(value)
    if not (isinstance(value, str) and value):
        raise RequestError(400, f"{param}: {kind} must be a non-empty string", param)
    _compile(kind, value, param)
    setattr(out, kind, value)
    return out


def _compile(kind: str, text: str, param: str) -> None:
    from engine import grammar  # NOTE: here, not at the top: it imports torch (seconds)

    try:
        grammar.check(grammar.GrammarSpec(grammar.GrammarKind(kind), text))
    except ValueError as e:
        raise RequestError(400, f"{param}: {e}", param) from None
