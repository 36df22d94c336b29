"""Chat messages as clients send them, checked and made ready for the chat template, and the
template's arguments (`template_arguments`).

OpenAI's clients send `content` as a string or as a list of parts; a text-only model takes the
text parts, joined with newlines (as vLLM does), and refuses the others by their type. An
assistant message may carry `tool_calls` instead of content; templates want each call's
`arguments` as an object, so the JSON string a client sends is parsed here (as vLLM does).
"""

from __future__ import annotations

import json

from router.body_values import flag
from router.errors import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
_KEPT = ("name", "tool_call_id")
"""Optional fields templates read, passed on as they are (strings)."""
TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                   "reasoning_effort")  # fmt: skip
"""A chat's template arguments, in vLLM's names."""
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_MEDIA_PARTS = ("image_url", "input_audio", "audio_url", "video_url", "file", "image")


def chat_messages(messages) -> list[dict]:
    """The conversation as the template gets it: each message {role, content (a string),
    and name, tool_call_id, tool_calls where given}. RequestError (400) names the first
    problem, with its index."""
    if not (isinstance(messages, list) and messages):
        raise RequestError(400, "messages: a non-empty list of messages", "messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(index: int, message) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(400, f"{where}: must be an object with `role` and `content`", "messages")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(
            400, f"{where}.role: {role!r} is not one of {', '.join(ROLES)}", "messages"
        )
    out = {"role": role}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise RequestError(400, f"{where}.tool_calls: only assistant messages have them",
                               "messages")  # fmt: skip
        out["tool_calls"] = _tool_calls(where, calls)
    content = message.get("content")
    if content is None and not (role == "assistant" and calls):
        raise RequestError(400, f"{where}.content: missing (a string or a list of text parts)",
                           "messages")  # fmt: skip
    out["content"] = "" if content is None else _text(where, content)
    for key in _KEPT:
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise RequestError(400, f"{where}.{key}: must be a string", "messages")
        out[key] = value
    return out


def _text(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where}.content: a string or a list of text parts", "messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _MEDIA_PARTS:
            raise RequestError(400, f"{where}.content[{j}]: {kind!r} parts are not supported: "
                               "this model takes text only", "messages")  # fmt: skip
        else:
            raise RequestError(400, f"{where}.content[{j}]: not a text part "
                               '({"type": "text", "text": "..."})', "messages")  # fmt: skip
    return "\n".join(texts)


def _tool_calls(where: str, calls) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls: must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise RequestError(400, f"{where}.tool_calls[{j}]: needs function.name", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise RequestError(400, f"{where}.tool_calls[{j}].function.arguments: not JSON",
                                   "messages") from None  # fmt: skip
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": name, "arguments": arguments}})  # fmt: skip
    return out


def template_arguments(body: dict) -> dict:
    """The chat template's arguments; reasoning_effort is passed to it as a variable (and
    enable_thinking, as vLLM does)."""
    template = {"add_generation_prompt": flag(body, "add_generation_prompt", True),
                "continue_final_message": flag(body, "continue_final_message", False)}  # fmt: skip
    if template["add_generation_prompt"] and template["continue_final_message"]:
        raise RequestError(400, "continue_final_message: needs add_generation_prompt: false",
                           "continue_final_message")  # fmt: skip
    kwargs = body.get("chat_template_kwargs", {})
    if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise RequestError(400, "chat_template_kwargs: must be an object",
                           "chat_template_kwargs")  # fmt: skip
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise RequestError(400, f"reasoning_effort: {effort!r} is not one of "
                               f"{', '.join(_EFFORTS)}", "reasoning_effort")  # fmt: skip
        kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none", **kwargs}
    if kwargs:
        template["chat_template_kwargs"] = kwargs
    return template


def echoed_text(messages: list[dict], template: dict) -> str:
    """What a chat's `echo` puts before each choice's content (vLLM's): the last message's
    content, where it is the assistant's (the answer continues it) or no generation prompt
    follows it; else nothing."""
    last = messages[-1]
    if template.get("add_generation_prompt", True) and last["role"] != "assistant":
        return ""
    return last.get("content") or ""
