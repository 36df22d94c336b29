"""Tools on /v1/chat/completions, the parts that need no vLLM (they run on every request):

  tools, tool_choice, parallel_tool_calls --check_tools--> ToolUse (or RequestError 400)
  ToolUse --template_tools--> the tools the chat template renders
          --tool_choice_schema--> the JSON Schema the whole output follows ("required" or a
                                  named function; None for "none" and "auto")
  the output --calls_from_constrained_output--> OpenAI `tool_calls` (whole)
             --ConstrainedCalls.feed--> `tool_calls` delta entries (streaming)

Each mirrors vLLM 0.32's legacy path for forced tool calls (`tool_parsers/utils.py`,
`parser/abstract_parser.py`, `tool_parsers/streaming.py`): the output is constrained to JSON
and parsed as such, whatever the model's native tool-call format. "auto" needs a model-format
parser, vLLM's own (router/output_parsing.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from router.errors import RequestError

_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, checked."""

    tools: list[dict] | None
    """{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}
    each, as the client sent them; None: no tools."""
    tool_choice: str | dict
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; when the
    client sent none: "auto" with tools, "none" without (vLLM's defaults)."""
    parallel_tool_calls: bool = True
    """False: at most one call (the schema allows one; parsers keep the first)."""

    @property
    def constrained(self) -> bool:
        """Whether the output is forced into calls by `tool_choice_schema`."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)


def check_tools(tools, tool_choice, parallel_tool_calls, auto_enabled: bool) -> ToolUse:
    """The request's tool fields (None where absent), checked as vLLM's ChatCompletionRequest
    and renderer check them; RequestError (400) says what is wrong. `auto_enabled`: a
    --tool-call-parser is configured."""
    if tools is not None:
        _check_tool_list(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    elif tool_choice != "none":
        if tools is None:
            raise RequestError(400, "When using `tool_choice`, `tools` must be set.",
                               "tool_choice")  # fmt: skip
        _check_choice(tools, tool_choice)
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    if not isinstance(parallel_tool_calls, bool):
        raise RequestError(400, f"parallel_tool_calls: {parallel_tool_calls!r} is not true or "
                           "false", "parallel_tool_calls")  # fmt: skip
    if tool_choice == "auto" and not auto_enabled:
        raise RequestError(400, '"auto" tool choice requires --tool-call-parser to be set '
                           '(or send tool_choice "none", "required" or a named function)',
                           "tool_choice")  # fmt: skip
    if tool_choice == "required":
        try:  # the schema merges the tools' $defs, which may conflict
            tool_choice_schema(tools, tool_choice, parallel_tool_calls)
        except ValueError as e:
            raise RequestError(400, str(e), "tools") from None
    return ToolUse(tools, tool_choice, parallel_tool_calls)


def _check_tool_list(tools) -> None:
    if tools == []:
        raise RequestError(400, "`tools` must not be an empty array. Either provide at least "
                           "one tool or omit the field entirely.", "tools")  # fmt: skip
    if not isinstance(tools, list):
        raise RequestError(400, "tools: must be a list of function tools", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(400, f'{where}: must be {{"type": "function", "function": '
                               '{...}}', "tools")  # fmt: skip
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f"{where}.function: must be an object with a string "
                               "`name`", "tools")  # fmt: skip
        for key, kind, name in (("description", str, "a string"),
                                ("parameters", dict, "a JSON Schema object"),
                                ("strict", bool, "true or false")):  # fmt: skip
            value = function.get(key)
            if value is not None and not isinstance(value, kind):
                raise RequestError(400, f"{where}.function.{key}: must be {name}", "tools")


def _check_choice(tools: list[dict], tool_choice) -> None:
    if tool_choice in ("auto", "required"):
        return
    if not isinstance(tool_choice, dict):
        raise RequestError(400, f"Invalid value for `tool_choice`: {tool_choice}! Only named "
                           'tools, "none", "auto" or "required" are supported.',
                           "tool_choice")  # fmt: skip
    if tool_choice.get("type", "function") != "function":
        raise RequestError(400, f'tool_choice.type: must be "function". {_USAGE}',
                           "tool_choice.type")  # fmt: skip
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise RequestError(400, f"Invalid value for `function`: `{function}` in `tool_choice`! "
                           f"{_USAGE}", "tool_choice.function")  # fmt: skip
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(400, f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                           f"{_USAGE}", "tool_choice.function.name")  # fmt: skip
    if all(tool["function"]["name"] != name for tool in tools):
        raise RequestError(400, "The tool specified in `tool_choice` does not match any of the "
                           "specified `tools`", "tool_choice")  # fmt: skip


def template_tools(tools: list[dict]) -> list[dict]:
    """The tools as vLLM hands them to the chat template (`ChatCompletionToolsParam.
    model_dump()`): known keys only; `description` and `parameters` always there (None when
    absent), `strict` only when set. Prefill parity needs the same dicts vLLM renders."""
    rendered = []
    for tool in tools:
        function = tool["function"]
        out = {"name": function["name"], "description": function.get("description"),
               "parameters": function.get("parameters")}  # fmt: skip
        if function.get("strict") is not None:
            out["strict"] = function["strict"]
        rendered.append({"type": "function", "function": out})
    return rendered


def tool_choice_schema(
    tools: list[dict] | None, tool_choice, parallel_tool_calls: bool
) -> dict | None:
    """The JSON Schema the whole output follows, as vLLM's `get_json_schema_from_tools`
    builds it: a named function's `parameters` (the output is its arguments); for "required"
    an array of {"name", "parameters"} objects, one of them at most without parallel calls,
    the tools' `$defs` merged at the top (ValueError on a conflict). None: unconstrained."""
    if tool_choice in ("none", "auto", None) or tools is None:
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        for tool in tools:
            if tool["function"]["name"] == name:
                return _object_or_empty(tool["function"].get("parameters"))
        raise ValueError(f"Tool '{name}' has not been passed in `tools`.")
    items, defs = [], {}
    for tool in tools:
        name, params = tool["function"]["name"], tool["function"].get("parameters")
        tool_defs = (params or {}).get("$defs", {})
        if not isinstance(tool_defs, dict):
            raise ValueError(f"`$defs` in the parameters of tool '{name}' must be an object, "
                             f"got {type(tool_defs).__name__}.")  # fmt: skip
        for def_name, schema in tool_defs.items():
            if defs.setdefault(def_name, schema) != schema:
                raise ValueError(f"Tool definition '{def_name}' has multiple schemas, which is "
                                 "not supported.")  # fmt: skip
        # NOTE: vLLM moves `$defs` to the top after choosing the parameters over the empty
        # object: {"$defs": ...} alone becomes {}, not the empty object.
        if params:
            params = {k: v for k, v in params.items() if k != "$defs"}
        else:
            params = _object_or_empty(params)
        items.append({"properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})  # fmt: skip
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _object_or_empty(params: dict | None) -> dict:
    # An empty or absent schema still constrains the arguments to an object.
    return params if params else {"type": "object", "properties": {}}


def calls_from_constrained_output(text: str, tool_choice) -> list[dict]:
    """OpenAI `tool_calls` from an output that followed `tool_choice_schema`: a named
    function's call with the text, verbatim, as its arguments (none when the text is blank,
    as vLLM does; its JSON is not checked, so a cut-off output gives cut-off arguments); for
    "required" the array's calls, each one's arguments re-serialized as vLLM does. ValueError
    when the text is not such an array."""
    if isinstance(tool_choice, dict):
        return [_call(tool_choice["function"]["name"], text)] if text.strip() else []
    try:
        elements = json.loads(text)
    except ValueError:
        raise ValueError("the output is not a JSON array of tool calls") from None
    if not isinstance(elements, list) or not all(_is_call(e) for e in elements):
        raise ValueError('the output is not an array of {"name", "parameters"} objects')
    return [_call(e["name"], _arguments(e)) for e in elements]


class ConstrainedCalls:
    """The streaming side of `calls_from_constrained_output`: `feed` each piece of the output,
    get `tool_calls` delta entries ({"index", and "id", "type", "function": {"name"}} the first
    time) whose arguments add up to the whole output's calls. A named call streams its
    arguments as they come (after any leading whitespace: a blank output is no call); a
    "required" call is sent whole once its array element is complete (vLLM streams those
    arguments piecewise; whole elements keep the re-serialized arguments equal to the
    non-streaming ones)."""

    def __init__(self, tool_choice) -> None:
        self.name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        self.text = ""
        self.calls = 0
        """Calls started so far."""
        self._pos = 0
        """Required: where scanning resumes, after the last complete element or separator."""
        self._in_array = False
        self._at_element = False
        """Required: a `[` or `,` was passed, so an element starts at `_pos` (after spaces)."""
        self._malformed = False

    def feed(self, text: str) -> list[dict]:
        self.text += text
        if self.name is not None:
            return self._named(text)
        return self._required() if "}" in text else []  # elements are objects: they end in }

    def _named(self, text: str) -> list[dict]:
        if self.calls:
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        if not self.text.strip():
            return []
        self.calls = 1
        return [_delta_head(0, self.name, self.text)]

    def _required(self) -> list[dict]:
        entries = []
        while (start := self._next_element()) is not None:
            try:
                element, end = _DECODER.raw_decode(self.text, start)
            except ValueError:  # not complete yet (or never: the whole-output parse says so)
                break
            if not _is_call(element):
                self._malformed = True  # nothing more to send
                break
            entries.append(_delta_head(self.calls, element["name"], _arguments(element)))
            self.calls += 1
            self._pos, self._at_element = end, False
        return entries

    def _next_element(self) -> int | None:
        """Where the next element starts, once it has started; None before that, and after
        the array's end."""
        if self._malformed:
            return None
        i = _skip_spaces(self.text, self._pos)
        if not self._at_element:
            if i >= len(self.text) or self.text[i] != ("," if self._in_array else "["):
                return None
            self._in_array, self._at_element = True, True
            i = _skip_spaces(self.text, i + 1)
            self._pos = i
        return i if i < len(self.text) else None


def new_call_id() -> str:
    """vLLM's tool-call id: "chatcmpl-tool-" and 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


def _call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _delta_head(index: int, name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "index": index,
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _is_call(element) -> bool:
    """An element vLLM's `TypeAdapter(list[FunctionDefinition])` takes: a string name and
    parameters that are an object or absent."""
    return (isinstance(element, dict) and isinstance(element.get("name"), str)
            and isinstance(element.get("parameters"), dict | None))  # fmt: skip


def _arguments(element: dict) -> str:
    return json.dumps(element.get("parameters"), ensure_ascii=False)


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i
