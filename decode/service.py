"""tandem.v1.DecodeService: the gRPC face of admission (decode/admission.py, which owns each
request's state) and the engine loop (decode/engine_loop.py). Every refusal is a gRPC status
whose message names the values. Once the engine has failed, Reserve, Generate and Stats answer
UNAVAILABLE with its failure (the router then marks the instance down, and its Stats probe keeps
it down until a restart).

Generate admits a request's choices (OpenAI's n: choice 0 from first_token_id, choice i from
other_choices[i - 1]) as one group of engine sequences sharing the ticket's KV, and streams them
interleaved: each message names its choice (`index`), and each choice's last one carries its
finish reason and its own usage; the stream ends after the last choice's. Every choice is
validated before any runs: a refused one fails the ticket. A ticket's first tokens (the
prefill's) are streamed as soon as the request is handed over, not once the engine thread admits
it at its next step boundary (a whole step later under load), except one that may end its choice
(a stop token, a length limit, a grammar's end): that one comes with its finish reason, from the
engine. A Generate with `local_prefill` has no ticket: admission makes it READY at once
(Admission.admit_local) and each of its choices prefills the prompt in the engine and samples
its own first token; from there it is the same path (stream, aborts, failures).

An Abort (or the Generate's client going away) takes effect in every state: a RESERVED or READY
ticket fails in admission; a RUNNING one is dropped by the engine loop, whose stream then ends
each choice with ABORT. An Abort naming `choices` stops only those choices of a RUNNING request
(the others go on) and leaves a request in any other state as it is. Generate's hand-over (take,
then submit) and Abort's look-up are one critical section, so an Abort never falls between
admission letting a request go and the engine loop having it queued.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time

import grpc

from decode.admission import Admission, RequestState, Reservation
from decode.engine_loop import Choice, EngineFailed, EngineLoop, Tokens, TokenStream
from decode.failures import AdmissionError, FailureKind
from decode.metrics import DecodeMetrics
from engine.grammar import Grammar, GrammarKind, GrammarSpec, allows
from engine.sampling import SamplingParams, TokenLogprobs
from engine.sampling_ranges import sampling_fields
from engine.sequence import FinishReason, Sequence, StopConditions
from prefill.ticket import mismatch
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc

_FINISH = {
    FinishReason.STOP: decode_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: decode_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: decode_pb2.FINISH_REASON_ABORT,
}


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        admission: Admission,
        loop: EngineLoop,
        destination: decode_pb2.Ticket,
        metrics: DecodeMetrics,
    ) -> None:
        """destination: every ticket's layout, shards and strides (decode/kv_shards.py)."""
        self.admission = admission
        self.loop = loop
        self.destination = destination
        self.layout = destination.layout
        self.metrics = metrics
        self._tokens_generated = 0
        self.draining = False
        """Set by the server's drain: new requests are refused, live ones run to their end."""
        self.drain_refusals = 0
        """New requests refused while draining: a router that was told first (its instance
        deregistered before the drain) sends none."""
        self._handover = threading.Lock()
        """Held by Generate from take() to submit() and by an abort's look-up (see the
        module's docstring)."""

    def Hello(self, request, context):
        problem = mismatch(self.layout, request.sender_layout)
        if problem:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"sender {request.sender_id or '?'} cannot write here: {problem}",
            )
        endpoints = [shard.endpoint for shard in self.destination.shards]
        return decode_pb2.HelloResponse(decode_layout=self.layout, endpoints=endpoints)

    def Reserve(self, request, context):
        self._check_engine(context)
        self._refuse_if_draining(context)
        res = self._call(
            context,
            self.admission.reserve,
            request.request_id,
            list(request.prompt_token_ids),
            request.num_senders,
            request.max_tokens,
            request.transfer_timeout_ms / 1000,
        )
        deadline_unix_ms = int((time.time() + res.deadline - self.admission.clock()) * 1000)
        ticket = decode_pb2.Ticket(
            request_id=res.request_id,
            generation=res.generation,
            num_tokens=len(res.prompt_ids),
            block_ids=res.block_ids,
            num_senders=res.num_senders,
            deadline_unix_ms=deadline_unix_ms,
            num_cached_tokens=res.num_cached_tokens,
        )
        ticket.MergeFrom(self.destination)
        return decode_pb2.ReserveResponse(ticket=ticket)

    def Commit(self, request, context):
        return self._call(context, self.commit, request)

    def commit(self, request: decode_pb2.CommitRequest) -> decode_pb2.CommitResponse:
        """One sender's commit, however it came: the Commit RPC, or a notification of the KV
        transport (decode.commit_notices). Raises AdmissionError when refused."""
        committed, expected = self.admission.commit(
            request.request_id,
            request.generation,
            request.sender_rank,
            request.bytes_written,
            request.layers_written,
            request.error,
            request.num_senders,
        )
        self.metrics.transfer_bytes.labels(str(request.sender_rank)).inc(request.bytes_written)
        return decode_pb2.CommitResponse(committed_senders=committed, expected_senders=expected)

    def Generate(self, request, context):
        started = time.monotonic()
        local = request.HasField("local_prefill")
        if local:
            res = self._admit_local(request, context)
        else:
            res = self._call(
                context, self.admission.wait_ready, request.request_id, request.generation
            )
        self._check_engine(context)
        choices = self._new_choices(res, request, context)
        stream = self._hand_over(res, choices, context)
        self.metrics.local_prefills.inc(local)
        streamed = [
            Tokens(i, [c.first_token], [] if c.first_logprobs is None else [c.first_logprobs])
            for i, c in enumerate(choices)
            if c.streamed
        ]

        def client_gone() -> None:  # the RPC has ended: a no-op unless the request is live
            self._abort(res.request_id, res.generation, "client gone")

        if not context.add_callback(client_gone):  # gone already
            client_gone()
        first = True
        for item in itertools.chain(streamed, stream):
            if isinstance(item, EngineFailed):
                context.abort(grpc.StatusCode.UNAVAILABLE, item.message)
            if first and not local:  # a local prefill has no handover
                self.metrics.handover_seconds.observe(time.monotonic() - started)
            first = False
            self.metrics.tokens_generated.inc(len(item.token_ids))
            self._tokens_generated += len(item.token_ids)
            message = _response(item)
            if item.index == 0 and stream.prompt_logprobs is not None:  # choice 0's first
                message.prompt_logprobs.extend(_logprobs_pb(lp) for lp in stream.prompt_logprobs)
                stream.prompt_logprobs = None
            yield message

    def Abort(self, request, context):
        if request.choices:
            aborted = self._abort_choices(
                request.request_id, request.generation, list(request.choices)
            )
        else:
            aborted = self._abort(
                request.request_id,
                request.generation,
                request.reason or "aborted by client",
                writers_possible=not request.ticket_undelivered,
            )
        return decode_pb2.AbortResponse(aborted=aborted)

    def Stats(self, request, context):
        self._check_engine(context)
        self.admission.expire()
        pool = self.admission.pool
        engine = self.loop.snapshot
        return decode_pb2.StatsResponse(
            kv_blocks_total=pool.num_total,
            kv_blocks_free=pool.num_free,
            kv_blocks_quarantined=self.admission.num_quarantined_blocks,
            running=engine.running,
            waiting=engine.waiting,
            reserved=self.admission.num_reserved,
            outstanding_tokens=engine.outstanding_tokens,
            tokens_generated=self._tokens_generated,
            layout=self.layout,
            max_model_len=self.admission.max_model_len,
            draining=self.draining,
            instance_id=self.destination.decode_instance_id,
            prefix_caching=self.admission.prefix_cache is not None,
        )

    def _refuse_if_draining(self, context) -> None:
        if self.draining:
            self.drain_refusals += 1
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "draining: this decode server is shutting down; send new requests to another",
            )

    def _admit_local(self, request, context) -> Reservation:
        """A prompt this server prefills itself: READY at once (no Reserve came before)."""
        self._check_engine(context)
        self._refuse_if_draining(context)
        if request.other_choices:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "other_choices: not with local_prefill (local_prefill.n gives the choices)",
            )
        return self._call(
            context,
            self.admission.admit_local,
            request.request_id,
            list(request.local_prefill.prompt_token_ids),
            request.max_tokens,
        )

    def _new_choices(self, res: Reservation, request, context) -> list[Choice]:
        """The engine's sequences for a READY ticket's choices, each with its first token (none
        for a local prefill's: the engine samples them); a refused parameter of any choice fails
        the ticket."""
        if request.HasField("local_prefill"):
            starts = [("", None)] * (request.local_prefill.n or 1)
        else:  # Choice 0's start is the request's own fields, named as a ChoiceStart's.
            starts = [("", request)]
            starts += [(f"other_choices[{i}].", s) for i, s in enumerate(request.other_choices)]
        try:
            fields = sampling_fields(request.sampling)
            if not request.HasField("local_prefill"):  # the prefill computed them
                fields.pop("prompt_logprobs", None)
            params = SamplingParams(**fields)
            first_logprobs = [
                None if params.logprobs is None or start is None else _first_logprobs(prefix, start)
                for prefix, start in starts
            ]
            # NOTE: on this RPC thread, new_choices reads only the engine's config, and
            # engine.sequences to refuse a live id, which never holds one here: admission keeps
            # an id live until its stream has ended, after the engine dropped its sequences.
            seqs = self.loop.engine.new_choices(
                res.request_id,
                res.prompt_ids,
                params,
                StopConditions(
                    max_tokens=request.max_tokens or res.max_tokens or 1,
                    min_tokens=request.min_tokens,
                    stop_token_ids=tuple(request.stop_token_ids),
                    ignore_eos=request.ignore_eos,
                ),
                len(starts),
                self._grammar(request),
            )
            for seq, (prefix, start) in zip(seqs, starts, strict=True):
                if start is not None:
                    self._check_first_token(seq, prefix, start.first_token_id)
        except ValueError as e:
            self.admission.abort(
                res.request_id, res.generation, f"bad request: {e}", kind=FailureKind.BAD_REQUEST
            )
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        firsts = [None if start is None else start.first_token_id for _, start in starts]
        # Streamed by Generate at once where the token surely does not end its choice.
        return [
            Choice(
                seq, first, logprobs, first is not None and seq.first_token_finishes(first) is False
            )
            for seq, first, logprobs in zip(seqs, firsts, first_logprobs, strict=True)
        ]

    def _check_first_token(self, seq: Sequence, prefix: str, token: int) -> None:
        """A choice's first token must be one the model (and its grammar) can continue from."""
        vocab = self.loop.engine.model_config.vocab_size
        if token >= vocab:
            raise ValueError(
                f"{prefix}first_token_id: {token} is outside the vocabulary [0, {vocab})"
            )
        # Checked here, not advanced: the engine accepts it when it appends it.
        if seq.grammar is not None and not allows(seq.grammar, token):
            raise ValueError(
                f"{prefix}first_token_id: {token} is not allowed by structured_output (the "
                "prefill must sample it under the same constraint)"
            )

    def _grammar(self, request: decode_pb2.GenerateRequest) -> Grammar | None:
        """The request's structured output, compiled on this RPC thread (it takes milliseconds;
        the first one also loads the tokenizer and xgrammar, seconds): never on the engine's."""
        if not request.HasField("structured_output"):
            return None
        try:
            return self.loop.engine.grammars.compile(_grammar_spec(request.structured_output))
        except ValueError as e:
            raise ValueError(f"structured_output: {e}") from None

    def _hand_over(self, res: Reservation, choices: list[Choice], context) -> TokenStream:
        """READY -> RUNNING: the ticket's blocks go to the engine loop with its choices, a group
        named by the request id (admission keeps it live until the group's stream has ended)."""
        with self._handover:
            blocks = self._call(context, self.admission.take, res)
            on_end = functools.partial(self.admission.finish, res)
            return self.loop.submit(res.request_id, choices, blocks, on_end)

    def _abort(
        self, request_id: str, generation: int, reason: str, writers_possible: bool = True
    ) -> bool:
        """Stops a live request in whatever state it is; False if none matched."""
        with self._handover:
            found = self.admission.abort(request_id, generation, reason, writers_possible)
            if found is RequestState.RUNNING:
                # NOTE: put after the submit (take and submit share the lock), so the engine
                # loop has the sequence by the time it handles this, or has finished it.
                self.loop.abort(request_id)
        return found is not None

    def _abort_choices(self, request_id: str, generation: int, choices: list[int]) -> bool:
        """Stops these choices of a RUNNING request; False (and nothing done) in any other
        state. Choices out of range or finished are passed over by the engine loop."""
        with self._handover:  # as `_abort`: put after the submit, if there was one
            running = self.admission.live_state(request_id, generation) is RequestState.RUNNING
            if running:
                self.loop.abort(request_id, choices)
        return running

    def _check_engine(self, context) -> None:
        if self.loop.failure is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.loop.failure)

    @staticmethod
    def _call(context, fn, *args):
        try:
            return fn(*args)
        except AdmissionError as e:
            context.abort(e.code, str(e))


def _response(tokens: Tokens) -> decode_pb2.GenerateResponse:
    message = decode_pb2.GenerateResponse(
        index=tokens.index,
        token_ids=tokens.token_ids,
        logprobs=[_logprobs_pb(lp) for lp in tokens.logprobs],
    )
    finished = tokens.finished
    if finished is not None:  # with the tokens: the finishing one is identifiable
        message.finish_reason = _FINISH[finished.reason]
        message.usage.prompt_tokens = finished.prompt_tokens
        message.usage.completion_tokens = finished.completion_tokens
        if finished.spec_decode is not None:
            histogram, drafted = finished.spec_decode
            message.spec_decode.acceptance_histogram.extend(histogram)
            message.spec_decode.num_draft_tokens = drafted
    return message


def _logprobs_pb(logprobs: TokenLogprobs) -> decode_pb2.TokenLogprobs:
    return decode_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top_token_ids=logprobs.top_token_ids,
        top_logprobs=logprobs.top_logprobs,
        rank=logprobs.rank or 0,
    )


def _grammar_spec(message: decode_pb2.StructuredOutput) -> GrammarSpec:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError("names no kind (json_schema, json_object, regex or grammar)")
    if kind == "json_object" and not message.json_object:
        raise ValueError("json_object: must be true when set")
    text = "" if kind == "json_object" else getattr(message, kind)
    return GrammarSpec(GrammarKind(kind), text, message.compact_whitespace)


def _first_logprobs(prefix: str, start) -> TokenLogprobs:
    """A choice's first entry of the stream is the prefill's (a ChoiceStart's, or the request's
    own): without it the stream's logprobs would not line up with its tokens."""
    if not start.HasField("first_token_logprobs"):
        raise ValueError(f"{prefix}first_token_logprobs: required when sampling.logprobs is set")
    first = start.first_token_logprobs
    if len(first.top_token_ids) != len(first.top_logprobs):
        raise ValueError(
            f"{prefix}first_token_logprobs: {len(first.top_token_ids)} top_token_ids but "
            f"{len(first.top_logprobs)} top_logprobs"
        )
    return TokenLogprobs(first.logprob, tuple(first.top_token_ids), tuple(first.top_logprobs))
