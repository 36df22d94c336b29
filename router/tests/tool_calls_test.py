"""router/tool_calls.py against vLLM 0.32's own code on the same input: the schema forced tool
choices constrain the output with, the tools the template renders, the calls parsed from a
forced output (whole and streamed), and the refusals of bad tool fields."""

from __future__ import annotations

import copy
import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
from vllm.tool_parsers.utils import get_json_schema_from_tools

from router.errors import RequestError
from router.tool_calls import (
    ConstrainedCalls,
    ToolUse,
    calls_from_constrained_output,
    check_tools,
    template_tools,
    tool_choice_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
BARE = {"type": "function", "function": {"name": "now"}}
EMPTY = {"function": {"name": "noop", "parameters": {}, "strict": True}}
DEFS_A = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "$defs": {"point": {"type": "array", "items": {"type": "number"}}},
    "properties": {"to": {"$ref": "#/$defs/point"}}}}}  # fmt: skip
DEFS_B = {"type": "function", "function": {"name": "draw", "parameters": {
    "$defs": {"point": {"type": "array", "items": {"type": "number"}},
              "color": {"enum": ["red", "blue"]}},
    "type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}}}}  # fmt: skip
ONLY_DEFS = {"type": "function", "function": {"name": "odd", "parameters": {"$defs": {}}}}
TOOL_LISTS = [[WEATHER], [WEATHER, BARE, EMPTY], [DEFS_A, DEFS_B, WEATHER], [ONLY_DEFS, BARE]]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def vllm_request(tools, tool_choice, parallel_tool_calls=True) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls})  # fmt: skip


@pytest.mark.parametrize("tools", TOOL_LISTS)
@pytest.mark.parametrize("parallel", [True, False])
def test_the_schema_is_vllms(tools, parallel):
    choices = ["none", "auto", "required", *(named(t["function"]["name"]) for t in tools)]
    for choice in choices:
        sent = copy.deepcopy(tools)
        ours = tool_choice_schema(sent, choice, parallel)
        request = vllm_request(tools, choice, parallel)  # vLLM's pops $defs from its copy
        assert ours == get_json_schema_from_tools(
            request.tool_choice, request.tools, request.parallel_tool_calls
        ), choice
        assert sent == tools  # the request's tools are left as they came


def test_conflicting_defs_are_refused_like_vllm():
    other = copy.deepcopy(DEFS_B)
    other["function"]["parameters"]["$defs"]["point"] = {"type": "string"}
    with pytest.raises(ValueError, match="'point' has multiple schemas"):
        tool_choice_schema([DEFS_A, other], "required", True)
    refused = refusal([DEFS_A, other], "required")
    assert (refused.status, refused.param) == (400, "tools")
    assert tool_choice_schema([DEFS_A, other], named("move"), True)  # one tool: no merging


@pytest.mark.parametrize("tools", TOOL_LISTS)
def test_the_template_gets_vllms_tool_dicts(tools):
    assert template_tools(tools) == [t.model_dump() for t in vllm_request(tools, "auto").tools]


@pytest.fixture(scope="module")
def vllm_json_calls():
    """vLLM's parsing of forced calls: a parser without a native structural tag (pythonic)
    takes the JSON path, the one the router's schema leads to."""
    return ParserManager.get_parser(tool_parser_name="pythonic", enable_auto_tools=True)


FORCED = [
    (named("get_weather"), '{"city": "Köln"}'),
    (named("get_weather"), ' {\n  "city" : "Paris"}\n'),
    (named("now"), "   "),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Köln"}}]'),
    ("required", '[ {"name": "now", "parameters": {}} ,\n{"parameters": {"city": "Oslo"}, '
                 '"name": "get_weather"}, {"name": "now"}]'),
]  # fmt: skip


@pytest.mark.parametrize(("choice", "text"), FORCED)
def test_forced_calls_are_parsed_as_vllm_parses_them(vllm_json_calls, choice, text):
    ours = calls_from_constrained_output(text, choice)
    request = vllm_request([WEATHER, BARE], choice)
    _, content, theirs = vllm_json_calls(None, request.tools).parse(text, request, True)
    assert content is None
    assert [c["function"] for c in ours] == [
        {"name": c.name, "arguments": c.arguments} for c in theirs
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") and len(c["id"]) == 30 for c in ours)
    assert all(c["type"] == "function" for c in ours)


@pytest.mark.parametrize("text", ['[{"name": "now", "parameters": {}', "Sure!", '{"name": "now"}',
                                  '[{"name": 3, "parameters": {}}]', '[{"name": "now", '
                                  '"parameters": [1]}]'])  # fmt: skip
def test_a_malformed_required_output_is_a_value_error(vllm_json_calls, text):
    with pytest.raises(ValueError):
        calls_from_constrained_output(text, "required")
    request = vllm_request([BARE], "required")  # vLLM: no calls, silently
    assert vllm_json_calls(None, request.tools).parse(text, request, True)[2] == []


@pytest.mark.parametrize(("choice", "text"), FORCED)
@pytest.mark.parametrize("step", [1, 3])
def test_streamed_forced_calls_add_up_to_the_whole_ones(choice, text, step):
    stream = ConstrainedCalls(choice)
    entries = [e for i in range(0, len(text), step) for e in stream.feed(text[i : i + step])]
    assert reassembled(entries) == [c["function"] for c in
                                    calls_from_constrained_output(text, choice)]  # fmt: skip
    heads = [e for e in entries if "id" in e]
    assert [e["index"] for e in heads] == list(range(len(heads)))


def test_a_required_call_is_sent_once_its_element_is_complete():
    stream = ConstrainedCalls("required")
    assert stream.feed('[{"name": "get_weather", "parameters": {"city": "Oslo"}') == []
    (entry,) = stream.feed("}, ")
    assert entry["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert stream.feed('{"name": 7, "parameters": {}}') == []  # malformed: nothing more
    assert stream.feed('{"name": "now", "parameters": {}}]') == []


def reassembled(entries: list[dict]) -> list[dict]:
    """Tool-call deltas put together as a client does: by index."""
    calls: dict[int, dict] = {}
    for entry in entries:
        call = calls.setdefault(entry["index"], {"name": "", "arguments": ""})
        call["name"] += entry["function"].get("name") or ""
        call["arguments"] += entry["function"].get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def refusal(tools, tool_choice, parallel=None, auto_enabled=True) -> RequestError:
    with pytest.raises(RequestError) as refused:
        check_tools(tools, tool_choice, parallel, auto_enabled)
    return refused.value


def test_defaults_are_vllms():
    assert check_tools([WEATHER], None, None, True) == ToolUse([WEATHER], "auto", True)
    assert check_tools(None, None, None, False) == ToolUse(None, "none", True)
    assert check_tools(None, "none", False, False) == ToolUse(None, "none", False)
    use = check_tools([WEATHER, BARE], named("now"), None, False)
    assert use.constrained and not check_tools([BARE], "none", None, False).constrained
    assert check_tools([BARE], "required", True, False).constrained


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [([], None, "tools", "must not be an empty array"),
     ({"name": "f"}, None, "tools", "list of function tools"),
     ([{"type": "retrieval"}], None, "tools", '"type": "function"'),
     ([{"function": {"description": "no name"}}], None, "tools", "string `name`"),
     ([{"function": {"name": "f", "parameters": []}}], None, "tools", "parameters: must be"),
     ([{"function": {"name": "f", "strict": "yes"}}], None, "tools", "strict: must be"),
     ([{"function": {"name": "f", "description": 5}}], None, "tools", "description: must"),
     (None, "auto", "tool_choice", "`tools` must be set"),
     (None, "required", "tool_choice", "`tools` must be set"),
     ([BARE], "any", "tool_choice", "Invalid value for `tool_choice`: any!"),
     ([BARE], {"type": "function"}, "tool_choice.function", "Invalid value for `function`"),
     ([BARE], {"function": {"name": ""}}, "tool_choice.function.name", "Invalid `name`"),
     ([BARE], {"type": "x", "function": {"name": "now"}}, "tool_choice.type", "must be"),
     ([BARE], named("later"), "tool_choice", "does not match any of the specified `tools`")],
)  # fmt: skip
def test_bad_tool_fields_are_refused_as_vllm_refuses_them(tools, choice, param, words):
    refused = refusal(tools, choice)
    assert (refused.status, refused.param) == (400, param)
    assert words in str(refused)


def test_auto_needs_a_tool_call_parser():
    for choice in ("auto", None):  # tools without tool_choice are "auto", as in vLLM
        refused = refusal([BARE], choice, auto_enabled=False)
        assert refused.param == "tool_choice" and "--tool-call-parser" in str(refused)
    assert check_tools([BARE], "required", None, False).tool_choice == "required"


def test_parallel_tool_calls_is_a_boolean():
    refused = refusal([BARE], "required", parallel="false")
    assert (refused.status, refused.param) == (400, "parallel_tool_calls")
    schema = tool_choice_schema([BARE], "required", False)
    assert schema["maxItems"] == 1 and json.dumps(schema)
