"""What the orchestrator reads and writes on the wire: a prefill's 200 reply as each choice's
first token (and the prompt's log-probabilities), the Generate request of a ticket or of a
local prefill, a Generate message as Tokens and a Finished, and a prefill's 4xx as the client
gets it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proto.tandem.v1 import decode_pb2
from router.clients import PrefillReply
from router.generation import Finished, GenerationRequest, Tokens
from router.logprobs import first_token_logprobs, prompt_token_logprobs

FINISH = {
    decode_pb2.FINISH_REASON_STOP: "stop",
    decode_pb2.FINISH_REASON_LENGTH: "length",
    decode_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class FirstToken:
    """Where one choice starts: the prefill's token, and its logprobs when asked."""

    token_id: int
    logprobs: decode_pb2.TokenLogprobs | None


class FirstTokenMissing(ValueError):
    """A prefill's 200 reply without the first tokens asked for."""


def first_tokens(
    reply: dict, request: GenerationRequest
) -> tuple[list[FirstToken], list[decode_pb2.TokenLogprobs] | None]:
    """Each choice's first token from a prefill's 200 reply (its `token_ids`, which vLLM returns
    with return_token_ids), and the prompt's log-probabilities where asked; FirstTokenMissing or
    LogprobsError when something asked for is missing. The connector's kv_transfer_params must
    be there too: without it no KV was sent."""
    sampling, n = request.sampling, request.n
    if not isinstance((reply.get("kv_transfer_params") or {}).get("first_token_id"), int):
        raise FirstTokenMissing(
            "answered without kv_transfer_params.first_token_id: is it tandem's prefill "
            "server, or vLLM with TandemConnector?"
        )
    choices = {c.get("index"): c for c in reply.get("choices") or [] if isinstance(c, dict)}
    firsts = []
    for index in range(n):
        token_ids = choices.get(index, {}).get("token_ids")
        if not (isinstance(token_ids, list) and token_ids and type(token_ids[0]) is int):
            raise FirstTokenMissing(f"answered without choices[{index}].token_ids")
        logprobs = None
        if sampling.HasField("logprobs"):
            logprobs = first_token_logprobs(choices[index], sampling.logprobs)
        firsts.append(FirstToken(token_ids[0], logprobs))
    prompt = None
    if sampling.HasField("prompt_logprobs"):
        prompt = prompt_token_logprobs(choices[0], request.prompt_ids, sampling.prompt_logprobs)
    return firsts, prompt


def message_items(message: decode_pb2.GenerateResponse) -> list[Tokens | Finished]:
    """A Generate message's tokens, and its choice's end if it is the last."""
    items: list[Tokens | Finished] = []
    if message.token_ids:
        on_stop = message.finish_reason == decode_pb2.FINISH_REASON_STOP
        items.append(Tokens(list(message.token_ids), list(message.logprobs), on_stop,
                            message.index))  # fmt: skip
    if message.finish_reason != decode_pb2.FINISH_REASON_UNSPECIFIED:
        usage = message.usage
        spec = message.spec_decode if message.HasField("spec_decode") else None
        items.append(Finished(FINISH[message.finish_reason], usage.prompt_tokens,
                              usage.completion_tokens, message.index, spec))  # fmt: skip
    return items


def generate_request(
    request: GenerationRequest,
    rid: str,
    ticket: decode_pb2.Ticket | None = None,
    firsts: Sequence[FirstToken] = (),
) -> decode_pb2.GenerateRequest:
    """The Generate call: of a ticket, with the choices' first tokens from its prefill; or, with
    no ticket, of a prompt the decode server prefills itself."""
    message = decode_pb2.GenerateRequest(
        request_id=rid, sampling=request.sampling, max_tokens=request.max_tokens,
        min_tokens=request.min_tokens, stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos, structured_output=request.structured,
    )  # fmt: skip
    if ticket is None:
        message.local_prefill.prompt_token_ids.extend(request.prompt_ids)
        message.local_prefill.n = request.n
        return message
    first, *others = firsts
    message.generation = ticket.generation
    message.first_token_id = first.token_id
    if first.logprobs is not None:
        message.first_token_logprobs.CopyFrom(first.logprobs)
    message.other_choices.extend(
        decode_pb2.ChoiceStart(first_token_id=c.token_id, first_token_logprobs=c.logprobs)
        for c in others
    )
    return message


def refusal(reply: PrefillReply) -> str:
    """A prefill's 4xx message as the client gets it: the error body's message (OpenAI's
    shape, or vLLM's older flat one), else the text."""
    body = reply.json or {}
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else body.get("message")
    return message if isinstance(message, str) and message else reply.text[:500]
