"""The prefill engine's thread (engine.engine_thread): runs prompts, sends their KV layer by
layer to the decode server named in each request's ticket, and commits.

A job is one choice of a completion (one sequence in the engine); a request's choices are
submitted together and admitted in one go, so they prefill in the same forward (as far as the
scheduler's token budget allows). At most one of them carries the ticket: see `submit`.

A job's life: submit() -> queued -> admitted (ticket: a KvSender session opens; Hello and
connect go on in the background) -> prefilled in the engine's next steps, its layers handed to
the sender as they are computed -> sampled -> (ticket: the sender waits for the writes and
commits, off the engine thread) -> its future resolves. The job's blocks are held until its
writes have ended, then released on the engine thread.

If the engine raises (a CUDA error, a bug), its state is lost: every job's future fails with a
503 naming the error at once, and so does every later one; `failure` says what happened, and
/health answers 503 until the server is restarted.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.engine_thread import EngineThread
from engine.grammar import Grammar
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams, TokenLogprobs
from engine.sequence import Sequence, StopConditions
from engine.step_plan import StepPlan
from engine.tp_workers import TpWorkers
from prefill.kv_sender import KvSender
from prefill.publisher import KvPublisher, LayerwiseSend
from prefill.rank_sends import wait_for_ranks
from prefill.send_session import SendStats, SessionState
from prefill.ticket import KvTransfer

RANK_REPORT_GRACE_S = 5.0
"""How long past a send's deadline rank 0 waits for another rank to report its end (a rank
stops writing at the deadline; its commit and report follow)."""


class PrefillError(Exception):
    """The request cannot be served; `status` is the HTTP status to answer with, `param` the
    request field at fault, if one is."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class Job:
    """One choice of a completion request: one sequence in the engine."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: StopConditions
    transfer: KvTransfer | None
    """The ticket to send the prompt's KV to; None: sample only."""
    grammar: Grammar | None = None
    """Structured output: the sampled tokens are constrained to it."""
    future: Future = field(default_factory=Future)
    send: LayerwiseSend | None = None
    request_id: str = ""
    seq: Sequence | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Each generated token's, when sampling.logprobs is set."""
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    """The prompt's, when sampling.prompt_logprobs is set (engine/prompt_logprobs.py)."""
    submitted: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    """When the engine thread took it (time.monotonic(), as `submitted` and `sampled`)."""
    sampled: float | None = None
    """When its first token was sampled."""

    def fail(self, error: PrefillError) -> None:
        """Fails the job's future, unless its caller has given up on it (cancelled it)."""
        with contextlib.suppress(InvalidStateError):
            self.future.set_exception(error)

    def resolve(self, finish_reason: str, kv_transfer_params: dict | None) -> None:
        """Resolves the job's future with its sequence's outcome (unless given up on)."""
        seq = self.seq
        logprobs = self.logprobs if self.sampling.logprobs is not None else None
        result = Result(
            seq.output_ids, finish_reason, seq.num_prompt_tokens, kv_transfer_params, logprobs,
            self._timing(), seq.num_cached_tokens or 0, self.prompt_logprobs,
        )  # fmt: skip
        with contextlib.suppress(InvalidStateError):
            self.future.set_result(result)

    def _timing(self) -> dict[str, float]:
        """Milliseconds in each phase: queued for the engine thread, admitted to sampled (the
        forward, and waiting for a batch slot), sampled to resolved (the KV send's tail and
        commit)."""
        now = time.monotonic()
        admitted, sampled = self.admitted or now, self.sampled or now
        phases = {"queue": admitted - self.submitted, "forward": sampled - admitted}
        if self.transfer is not None:
            phases["send"] = now - sampled
        return {name: seconds * 1000 for name, seconds in phases.items()}


@dataclass(frozen=True)
class Result:
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    kv_transfer_params: dict | None
    logprobs: list[TokenLogprobs] | None = None
    """One per token_ids entry when the request's sampling.logprobs is set, else None."""
    timing: dict[str, float] = field(default_factory=dict)
    """Milliseconds by phase (Job._timing), for the reply's Server-Timing header."""
    cached_tokens: int = 0
    """Prompt tokens whose KV the prefix cache held (engine/prefix_cache.py)."""
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    """Prompt token i + 1's at [i], when the request's sampling.prompt_logprobs is set."""


@dataclass(frozen=True)
class _Admit:
    """Engine-thread command: one request's choices, admitted together."""

    jobs: tuple[Job, ...]


@dataclass(frozen=True)
class _ReleaseBlocks:
    """Engine-thread command: a sent job's blocks, held while its writes were in flight."""

    block_ids: list[int]


class PrefillWorker(EngineThread):
    def __init__(
        self,
        engine: LLMEngine,
        publisher: KvPublisher,
        sender: KvSender,
        senders: TpWorkers | None = None,
    ) -> None:
        """`publisher`'s kv_send says which forwards send a request's KV, and when."""
        self.publisher = publisher
        self.sender = sender
        self._live: dict[str, Job] = {}
        self._ranks_armed = False
        self._ids = iter(range(1, 1 << 62))
        self._tp = senders
        """The other tensor-parallel ranks, when each sends its heads (prefill/rank_sends.py)."""
        # Waits for the other ranks' sends to end, off the committer threads.
        self._rank_waits = ThreadPoolExecutor(4, thread_name_prefix="rank-sends")
        super().__init__(engine, server="prefill", thread_name="prefill-engine")

    def _ranks(self, method: str, *args) -> None:
        """Has every other rank's sender agent do the same (on the engine thread: in order
        with the steps)."""
        if self._tp is not None:
            self._tp.call_agents(method, *args)

    def submit(self, jobs: list[Job]) -> list[Future]:
        """Queues one request's choices; their futures, in the same order. The prompt's KV goes
        once, with the one job that carries the ticket. NOTE: each choice prefills the prompt
        itself (this engine has no prefix cache), so n choices cost n prompts' compute, batched
        into one forward. vLLM's n does the same with prefix caching off; with it on (its
        default) the children after the first reuse the first's full blocks, which vLLM caches
        as it allocates them, in the same step."""
        assert sum(job.transfer is not None for job in jobs) <= 1, "one KV transfer a request"
        self._put(_Admit(tuple(jobs)))
        return [job.future for job in jobs]

    def _admit(self, item: _Admit | _ReleaseBlocks) -> None:
        if isinstance(item, _ReleaseBlocks):
            self.engine.pool.free(item.block_ids)
            return
        for job in item.jobs:
            self._admit_job(job)

    def _admit_job(self, job: Job) -> None:
        job.admitted = time.monotonic()
        job.request_id = f"p{next(self._ids)}"
        if job.transfer is not None:
            session = self.sender.open(job.transfer)
            job.send = LayerwiseSend(
                self.sender, session, self.engine.kv_cache, self.engine.proposer_cache
            )
            self._ranks("open", job.request_id, job.transfer)
            if session.state is SessionState.FAILED:  # e.g. its deadline has passed already
                self._finish(job, "abort")
                return
        try:
            job.seq = self.engine.add_request(
                job.request_id, job.prompt_ids, job.sampling, job.stop, job.grammar
            )
        except ValueError as e:
            job.fail(PrefillError(400, str(e)))
            if job.send is not None:  # the decode server learns at once, not at the deadline
                self.sender.fail(job.send.session, str(e))
                self.sender.finish(job.send.session)
                self._ranks("fail", job.request_id, str(e))
                self._rank_waits.submit(self._wait_for_ranks, job)  # their reports, consumed
            return
        self._live[job.request_id] = job

    def _step(self) -> None:
        outputs = self.engine.step(before_run=self._arm)
        self.publisher.forward_done()
        if self._ranks_armed:
            self._ranks("forward_done")
            self._ranks_armed = False
        finished = []
        for out in outputs:
            job = self._live.get(out.seq_id)
            if job is None:
                continue
            if out.logprobs is not None:
                job.logprobs.append(out.logprobs)
            if out.prompt_logprobs is not None:
                job.prompt_logprobs = out.prompt_logprobs
            if out.finish_reason is not None:
                job.sampled = time.monotonic()
                finished.append((job, out.finish_reason.value))
        # Live until then: should the fill fail, the engine's failure fails them too.
        self._send_proposer_kv([job for job, _ in finished if job.send is not None])
        for job, finish_reason in finished:
            del self._live[job.request_id]
            self._finish(job, finish_reason)

    def _send_proposer_kv(self, jobs: list[Job]) -> None:
        """A speculating engine's (draft model, MTP): the proposer's KV of the sent prompts,
        computed now that their first token is known, posted after the model's layers."""
        if self.engine.proposer_cache is None:
            return
        sent = [job for job in jobs if job.send.complete]
        self.engine.fill_proposer([(job.seq, job.send.session.src_blocks) for job in sent])
        for job in sent:
            job.send.proposer_ready()

    def _fail_live(self, failure: str) -> None:
        for job in self._live.values():
            job.fail(PrefillError(503, failure))
        self._live.clear()

    def _refuse(self, item: _Admit | _ReleaseBlocks, failure: str) -> None:
        if isinstance(item, _Admit):
            # Jobs of it admitted before the engine failed were failed with the live ones.
            for job in item.jobs:
                job.fail(PrefillError(503, failure))

    def _arm(self, plan: StepPlan) -> bool:
        """Before a forward: the sends of prompts that complete in it post each layer (and,
        chunkwise, those of prompts it prefills a chunk of); returns whether the forward must
        run eagerly. A step of one token per prompt (a prompt's last chunk of one token) is
        decode-shaped: it replays a CUDA graph, which writes the KV without calling the
        layers' hooks, and its layers are posted once it is done."""
        armed, rank_armed = [], []
        for item in plan.scheduled:
            job = self._live.get(item.seq.seq_id)
            send = job.send if job is not None else None
            if send is None or not (item.samples or self.publisher.kv_send == "chunkwise"):
                continue
            blocks, end = list(item.seq.block_ids), item.start + item.num_new_tokens
            if not send.arm(blocks, end, item.samples):
                continue
            # Held until the writes have ended (every rank's): the engine frees a sequence's
            # blocks when it finishes (right after the step that samples) or is preempted.
            held = set(send.held)
            new = [block for block in blocks if block not in held]
            self.engine.pool.incref(new)
            send.held += new
            armed.append(send)
            rank_armed.append((job.request_id, blocks, end, item.samples))
        hooks = not plan.is_decode_only
        if rank_armed:
            self._ranks("arm", rank_armed, hooks)
            self._ranks_armed = True
        return self.publisher.arm(armed, hooks)

    def _finish(self, job: Job, finish_reason: str) -> None:
        if job.send is None:
            job.resolve(finish_reason, None)
            return
        sent = self.sender.finish(job.send.session)
        self._ranks("finish", job.request_id)
        sent.add_done_callback(
            lambda done: self._rank_waits.submit(self._sent, job, finish_reason, done.result())
        )

    def _wait_for_ranks(self, job: Job) -> str:
        """The other ranks' sends of the job ended: their first error, or ""."""
        if self._tp is None:
            return ""
        deadline = job.send.session.deadline + RANK_REPORT_GRACE_S
        return wait_for_ranks(self._tp.store, job.request_id, self._tp.tp.shape.size, deadline)

    def _sent(self, job: Job, finish_reason: str, stats: SendStats) -> None:
        """Once the job's writes have ended and it was committed, on every rank."""
        error = stats.error or self._wait_for_ranks(job)
        if job.send.held:
            self._put(_ReleaseBlocks(job.send.held))
        if error:
            job.fail(PrefillError(502, f"KV transfer failed: {error}"))
            return
        seq = job.seq
        kv_params = {
            "first_token_id": seq.output_ids[0],
            "bytes_written": stats.bytes_written,
            "layers": stats.layers,
            "transfer_ms": round(stats.seconds * 1000, 3),
            # After the forward: waiting for the last writes to land, then the Commit RPC.
            "send_wait_ms": round(stats.wait_seconds * 1000, 3),
            "commit_ms": round(stats.commit_seconds * 1000, 3),
            "prepare_ms": round(stats.prepare_seconds * 1000, 3),
            "post_ms": round(stats.post_seconds * 1000, 3),
            "write_ops": stats.write_ops,
            "posts": stats.posts,
        }
        job.resolve(finish_reason, kv_params)
