"""Structured outputs: the request fields that constrain the generated text, checked and turned
into one tandem.v1.StructuredOutput.

  response_format {"type": "json_object" | "json_schema"}         (OpenAI)
  structured_outputs {json | json_object | regex | choice | grammar, disable_any_whitespace}
  guided_json | guided_regex | guided_choice | guided_grammar      (vLLM's older names)

Each is read in vLLM's structured_outputs shape by engine/grammar.py `structured_outputs_spec`,
the reader tandem's prefill server uses too (a choice list becomes an EBNF grammar, as vLLM
builds it). Every grammar is parsed once here (`check`: xgrammar without a tokenizer), so a bad
one is a 400 before any backend is touched; the decode server and the prefill compile it against
the vocabulary.
The prefill gets it in vLLM's own `structured_outputs` field (`prefill_fields`), which tandem's
prefill server and vLLM both honour, so the first token obeys it too.
"""

from __future__ import annotations

from proto.tandem.v1 import decode_pb2
from router.errors import RequestError

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar")  # fmt: skip


def structured_output(body: dict) -> decode_pb2.StructuredOutput | None:
    """The constraint `body` asks for, or None; RequestError (400) names what is wrong."""
    asked = []  # (field, the constraint in vLLM's structured_outputs shape)
    response_format = _from_response_format(body.get("response_format", {"type": "text"}))
    if response_format is not None:
        asked.append(("response_format", response_format))
    if "structured_outputs" in body:
        asked.append(("structured_outputs", body["structured_outputs"]))
    asked += [(name, {name.removeprefix("guided_"): body[name]})
              for name in FIELDS[2:] if name in body]  # fmt: skip
    if len(asked) > 1:
        param = asked[1][0]
        raise RequestError(400, f"{param}: one constraint per request (also given: "
                           f"{asked[0][0]})", param)  # fmt: skip
    return _checked(*asked[0]) if asked else None


def json_schema(schema: dict, param: str) -> decode_pb2.StructuredOutput:
    """A constraint to `schema` (a forced tool call's), checked as a client's would be."""
    return _checked(param, {"json": schema})


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
        if not isinstance(schema, dict):
            raise RequestError(400, "response_format.json_schema.schema: a JSON Schema object "
                               "is required", "response_format")  # fmt: skip
        return {"json": schema}
    raise RequestError(400, f"response_format: type {kind!r} is not one of text, json_object, "
                       "json_schema", "response_format")  # fmt: skip


def _checked(param: str, value: object) -> decode_pb2.StructuredOutput:
    """`value` (vLLM's structured_outputs shape) read as the engine reads it, and its grammar
    parsed, as one StructuredOutput."""
    from engine import grammar  # NOTE: here, not at the top: it imports torch (seconds)

    try:
        spec = grammar.structured_outputs_spec(value)
        grammar.check(spec)
    except ValueError as e:
        raise RequestError(400, f"{param}: {e}", param) from None
    out = decode_pb2.StructuredOutput(compact_whitespace=spec.compact_whitespace)
    if spec.kind is grammar.GrammarKind.JSON_OBJECT:
        out.json_object = True
    else:  # the proto's fields are named as the kinds
        setattr(out, spec.kind.value, spec.text)
    return out
