"""/tokenize and /detokenize in vLLM's shapes, with the tokenization the router serves with:

POST /tokenize    {prompt, add_special_tokens?} or {messages, add_generation_prompt?}
                  -> {count, max_model_len, tokens, token_strs}
POST /detokenize  {tokens} -> {prompt}
"""

from __future__ import annotations

from router.body_values import flag
from router.errors import BackendError, RequestError
from router.messages import chat_messages
from router.prompts import PromptTokenizer
from router.requests import ServedModel, checked_body

_TOKENIZE = frozenset({"model", "prompt", "messages", "add_special_tokens",
                       "add_generation_prompt", "return_token_strs"})  # fmt: skip


async def tokenize(raw: bytes, model: ServedModel, prompts: PromptTokenizer) -> dict:
    body = checked_body(raw, model, _TOKENIZE)
    strs = flag(body, "return_token_strs", False)
    try:
        if "messages" in body:
            if not flag(body, "add_generation_prompt", True):
                raise RequestError(400, "add_generation_prompt: only true is supported",
                                   "add_generation_prompt")  # fmt: skip
            tokens = await prompts.chat(chat_messages(body["messages"]))
        elif isinstance(body.get("prompt"), str):
            special = flag(body, "add_special_tokens", True)
            tokens = await prompts.text(body["prompt"], special)
        else:
            raise RequestError(400, "give `prompt` (a string) or `messages`", "prompt")
    except BackendError as e:  # tokenized by a prefill that refused or failed
        raise RequestError(e.status, str(e)) from None
    tokenizer = prompts.local.tokenizer
    return {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens) if strs else None}  # fmt: skip


def detokenize(raw: bytes, model: ServedModel, tokenizer) -> dict:
    tokens = checked_body(raw, model, frozenset({"model", "tokens"})).get("tokens")
    if not (isinstance(tokens, list) and all(
        type(t) is int and 0 <= t < model.vocab_size for t in tokens
    )):  # fmt: skip
        raise RequestError(400, f"tokens: a list of token ids below {model.vocab_size}", "tokens")
    return {"prompt": tokenizer.decode(tokens)}
