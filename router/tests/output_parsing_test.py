"""router/output_parsing.py with vLLM 0.32's parsers and the SmolLM2 tokenizer: whole outputs
parse as vLLM's parsers parse them, and the same outputs streamed token by token (through the
router's detokenizer) add up to the whole result."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.reasoning import ReasoningParserManager
from vllm.tokenizers.hf import get_cached_tokenizer
from vllm.tool_parsers import ToolParserManager

from router.detokenizer import IncrementalDetokenizer
from router.output_parsing import ChoiceParser, OutputParsing
from router.tool_calls import ToolUse, check_tools

MODEL = "tools/smollm2-135m-instruct"  # Bazel data: //tools:smollm2
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>'
NOW_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
HERMES_TEXTS = [
    "Sure, let me look. " + CALL,  # the text before <tool_call> is content
    CALL + "\n" + NOW_CALL,
    "No tags, just an answer: 2 < 3.",
]
QWEN3_TEXTS = [
    "<think>2 + 2, carry nothing</think>The answer is 4.",
    "<think>\nhmm\n</think>\n\nFine.",
    "thinking without an end, so all of it is reasoning, held back at the end: <",
]


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def parsings(hf) -> dict[str, OutputParsing]:
    return {
        "none": OutputParsing(hf),
        "hermes": OutputParsing(hf, tool_call_parser="hermes"),
        "qwen3": OutputParsing(hf, reasoning_parser="qwen3"),
        "both": OutputParsing(hf, tool_call_parser="hermes", reasoning_parser="qwen3"),
    }


@pytest.fixture(scope="module")
def hermes(parsings):
    return parsings["hermes"]


@pytest.fixture(scope="module")
def qwen3(parsings):
    return parsings["qwen3"]


def start(parsing: OutputParsing, hf, choice=None, parallel=None, **kwargs) -> ChoiceParser:
    tools = TOOLS if choice is not None or parsing.auto_tools else None
    use = check_tools(tools, choice, parallel, parsing.auto_tools)
    prompt = hf.apply_chat_template([{"role": "user", "content": "Weather in Köln?"}],
                                    add_generation_prompt=True, tokenize=False)  # fmt: skip
    return parsing.start(use, hf(prompt)["input_ids"], **kwargs)


def streamed(choice: ChoiceParser, hf, text: str) -> dict:
    """The text generated token by token, detokenized as the router does, its deltas put
    together as a client puts them together."""
    detok = IncrementalDetokenizer(hf, skip_special_tokens=choice.skip_special_tokens)
    deltas = []
    for token in hf(text, add_special_tokens=False)["input_ids"]:
        deltas.append(choice.feed(detok.add([token]), [token]))
    deltas += [choice.feed(detok.flush(), []), choice.finish()]
    message = {"content": None, "reasoning": None}
    calls: dict[int, dict] = {}
    for delta in filter(None, deltas):
        for field in ("content", "reasoning"):
            if delta.get(field) is not None:
                message[field] = (message[field] or "") + delta[field]
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"name": "", "arguments": ""})
            call["name"] += entry["function"].get("name") or ""
            call["arguments"] += entry["function"].get("arguments") or ""
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def without_ids(message: dict) -> dict:
    calls = [c["function"] for c in message.get("tool_calls", [])]
    return {**message, **({"tool_calls": calls} if calls else {})}


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_whole_is_vllms_hermes(hermes, hf, text):
    request = ChatCompletionRequest.model_validate(
        {"messages": [], "tools": TOOLS, "tool_choice": "auto"})  # fmt: skip
    tokenizer = get_cached_tokenizer(hf)
    theirs = ToolParserManager.get_tool_parser("hermes")(tokenizer, request.tools)
    theirs = theirs.extract_tool_calls(text, request)
    message = start(hermes, hf).whole(text)
    assert message["content"] == theirs.content
    assert message["reasoning"] is None
    assert without_ids(message).get("tool_calls", []) == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in theirs.tool_calls
    ]


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_streamed_adds_up_to_the_whole(hermes, hf, text):
    whole = without_ids(start(hermes, hf).whole(text))
    assert streamed(start(hermes, hf), hf, text) == whole
    if "<tool_call>" not in text:
        assert whole == {"content": text, "reasoning": None}


def test_hermes_calls_and_their_content(hermes, hf):
    message = start(hermes, hf).whole(HERMES_TEXTS[0])
    assert message["content"] == "Sure, let me look. "
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Köln"}'}


@pytest.mark.parametrize("text", QWEN3_TEXTS)
def test_qwen3_split_is_vllms_and_streams_alike(qwen3, hf, text):
    request = ChatCompletionRequest.model_validate({"messages": []})
    theirs = ReasoningParserManager.get_reasoning_parser("qwen3")(get_cached_tokenizer(hf))
    reasoning, content = theirs.extract_reasoning(text, request)
    whole = start(qwen3, hf).whole(text)
    assert whole == {"content": content, "reasoning": reasoning}
    assert streamed(start(qwen3, hf), hf, text) == whole


def test_qwen3_without_thinking_is_all_content(qwen3, hf):
    text = QWEN3_TEXTS[2]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert start(qwen3, hf, **off).whole(text) == {"content": text, "reasoning": None}
    assert streamed(start(qwen3, hf, **off), hf, text) == {"content": text, "reasoning": None}


def test_reasoning_then_tool_calls(parsings, hf):
    both = parsings["both"]
    text = "<think>They want Köln.</think>Checking. " + CALL
    whole = start(both, hf).whole(text)
    assert (whole["reasoning"], whole["content"]) == ("They want Köln.", "Checking. ")
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather"]
    assert streamed(start(both, hf), hf, text) == without_ids(whole)


@pytest.mark.parametrize(
    ("choice", "output", "calls"),
    [("required", '[{"name": "now", "parameters": {}}, {"name": "get_weather", '
      '"parameters": {"city": "Köln"}}]', [("now", "{}"), ("get_weather", '{"city": "Köln"}')]),
     ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Köln"}',
      [("get_weather", '{"city": "Köln"}')])],
)  # fmt: skip
@pytest.mark.parametrize("name", ["none", "hermes", "qwen3", "both"])
def test_forced_calls_after_any_reasoning(parsings, hf, name, choice, output, calls):
    thinks = name in ("qwen3", "both")
    text = ("<think>A call is due.</think>" if thinks else "") + output
    whole = start(parsings[name], hf, choice).whole(text)
    assert whole["content"] == "" and whole["reasoning"] == ("A call is due." if thinks else None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] \
        == calls  # fmt: skip
    stream = streamed(start(parsings[name], hf, choice), hf, text)
    assert stream == {**without_ids(whole), "content": None}  # deltas carry no empty content


def test_one_call_without_parallel_tool_calls(hermes, hf):
    text = CALL + "\n" + NOW_CALL
    single = start(hermes, hf, "auto", parallel=False)
    assert [c["function"]["name"] for c in single.whole(text)["tool_calls"]] == ["get_weather"]
    assert [c["name"] for c in streamed(start(hermes, hf, "auto", parallel=False), hf, text)
            ["tool_calls"]] == ["get_weather"]  # fmt: skip


def test_finish_reasons_are_vllms(hermes, hf):
    calling = start(hermes, hf)
    calling.whole(CALL)
    assert (calling.finish_reason("stop"), calling.finish_reason("length")) == (
        "tool_calls", "length")  # fmt: skip
    answering = start(hermes, hf)
    answering.whole("Sunny.")
    assert answering.finish_reason("stop") == "stop"
    named = start(hermes, hf, {"type": "function", "function": {"name": "now"}})
    named.whole("{}")
    assert named.finish_reason("stop") == "stop"  # a named call stays "stop"


def test_special_tokens_are_kept_where_vllms_parsers_ask(hermes, qwen3, hf):
    assert not start(hermes, hf).skip_special_tokens  # hermes with tools
    assert not start(hermes, hf, "required").skip_special_tokens
    assert start(hermes, hf, "none").skip_special_tokens
    assert not start(qwen3, hf).skip_special_tokens  # qwen3's engine reads its markers
    assert start(OutputParsing(hf), hf).skip_special_tokens
    plain = OutputParsing(hf).start(ToolUse(None, "none"), [], skip_special_tokens=False)
    assert not plain.skip_special_tokens  # the client's choice stands


@pytest.mark.parametrize(
    ("tools", "reasoning", "words"),
    [("hermes2", None, "--tool-call-parser 'hermes2': not one of vLLM's: apertus, "),
     (None, "r1", "--reasoning-parser 'r1': not one of vLLM's: "),
     # SmolLM2's vocabulary has neither <think> nor <|python_tag|> as a token:
     (None, "deepseek_r1", "--reasoning-parser deepseek_r1 cannot be used with the tokenizer"),
     ("llama3_json", None, "could not locate the bot token '<|python_tag|>'")],
)  # fmt: skip
def test_parsers_this_tokenizer_cannot_serve_fail_at_start_up(hf, tools, reasoning, words):
    with pytest.raises(ValueError) as refused:
        OutputParsing(hf, tools, reasoning)
    assert words in str(refused.value)
