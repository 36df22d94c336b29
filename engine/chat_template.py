"""A conversation rendered by a model's chat template, with the request's template arguments in
vLLM's names; the router and tandem's prefill server (its /tokenize) render alike through it.
No torch here: the router imports it."""

from __future__ import annotations

from collections.abc import Sequence


def render_chat(tokenizer, messages: Sequence[dict], template: dict | None = None) -> str:
    """`template`: add_generation_prompt (default true), continue_final_message, tools, and
    chat_template_kwargs (passed to the template as variables)."""
    template = template or {}
    arguments = dict(template.get("chat_template_kwargs") or {})
    for name in ("continue_final_message", "tools"):  # only when set: few templates know them
        if template.get(name):
            arguments[name] = template[name]
    add = template.get("add_generation_prompt", True)
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add, **arguments
    )
