"""A request body's JSON object, read alike by the router and tandem's prefill server: anything
else is the client's mistake (`InvalidBody`, answered 400 by each with OpenAI's error body), never
a server error. No torch here: the router imports it."""

from __future__ import annotations

import json
import re

__all__ = ["InvalidBody", "json_object"]

# JSON lets a string escape half a UTF-16 pair (\ud800); Python keeps it as a lone surrogate,
# which no tokenizer or UTF-8 encoder takes. Only such an escape can make one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class InvalidBody(ValueError):
    """A body that is not a JSON object of Unicode strings; the message says which."""


def json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError included; too deep a nesting
        raise InvalidBody("body: not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidBody("body: must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and _holds_lone_surrogate(body):
        raise InvalidBody("body: a string holds an unpaired UTF-16 surrogate (not Unicode)")
    return body


def _holds_lone_surrogate(body: dict) -> bool:
    pending: list = [body]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                return True
    return False
