"""The engine: a model, its paged KV cache, the scheduler and the runner, driven step by step.

    engine = LLMEngine.build(EngineConfig(model="path/to/hf-folder"))
    engine.add_request("r1", prompt_ids, SamplingParams(), StopConditions(max_tokens=32))
    while engine.has_unfinished:
        for out in engine.step(): ...

The decode server admits sequences whose prompt KV was written by a remote prefill with
`add_prefilled`; everything else is the same path. The n choices of one such prompt (OpenAI's n,
built by `new_choices`) are admitted together with `add_prefilled_choices`: they share the
prompt's full blocks, and each has its own copy of a partial last one. A request constrained to
a grammar (structured output) passes one compiled by `engine.grammars` (engine/grammar.py).
With speculative decoding (EngineConfig.speculative_config, engine/speculative.py) a step may
return several tokens of one sequence, in order: its accepted drafts, then the target's token.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.engine_parts import build_parts
from engine.grammar import Grammar, GrammarCompiler
from engine.kv_cache import BlockPool, KVCache, fork_blocks
from engine.launched_step import LaunchedStep
from engine.model_loader import Backend
from engine.model_runner import ModelRunner
from engine.prefix_cache import PrefixCache
from engine.sampling import Sampler, SamplingParams, TokenLogprobs
from engine.sampling_ranges import MAX_N, vocabulary_problem
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence, StopConditions
from engine.spec_build import acceptance_curve, build_proposer, proposer_cache_config
from engine.speculative import DRAFTS_AHEAD, Proposer, SpecStats
from engine.step_executor import StepExecutor
from engine.step_plan import StepPlan
from engine.tp_workers import AgentFactory, TpWorkers


@dataclass(frozen=True)
class _Caches:
    """Block copies in the model's cache and the proposer's (the same block ids)."""

    model: StepExecutor
    proposer: KVCache | None

    @property
    def block_size(self) -> int:
        return self.model.block_size

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.model.copy_blocks(src, dst)
        if self.proposer is not None:
            self.proposer.copy_blocks(src, dst)


@dataclass(frozen=True)
class StepOutput:
    seq_id: str
    token_id: int
    """The token generated for this sequence in this step."""
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None
    """token_id's log-probabilities, when the sequence's SamplingParams.logprobs is set."""
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    """On a sequence's first token, when its SamplingParams.prompt_logprobs is set: prompt
    token i + 1's log-probabilities at [i]."""


@dataclass
class LLMEngine:
    config: EngineConfig
    model_config: ModelConfig
    kv_cache: KVCache
    pool: BlockPool
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    async_scheduling: bool
    grammars: GrammarCompiler
    """Compiles structured outputs' grammars for this model's tokenizer (built at first use)."""
    proposer: Proposer | None = None
    """Speculative decoding's: proposes drafts for the sequences a step decodes."""
    tp_workers: TpWorkers | None = None
    """Tensor-parallel ranks 1.. (engine/tp_workers.py), when the engine has them."""
    verifies_ahead: bool = False
    """With async scheduling, a verification is followed by the next one launched before it
    is read, fed the drafts the proposer made on the device (HiddenStateProposer.ahead_of)."""
    spec_stats: SpecStats = field(default_factory=SpecStats)
    sequences: dict[str, Sequence] = field(default_factory=dict)
    _in_flight: LaunchedStep | None = None
    """A step planned ahead and launched, whose tokens the next `step` returns."""

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        wrap_attention: Callable[[Backend], Backend] | None = None,
        rank_agent: AgentFactory | None = None,
    ) -> LLMEngine:
        """`wrap_attention` decorates the device's attention backend, or an MLA model's latent
        writer (e.g. to act on each layer's freshly written KV). With tensor_parallel_size > 1
        the other ranks' processes start here, each with the agent `rank_agent` makes
        (engine/tp_workers.py); `close` stops them."""
        workers = None
        if config.tensor_parallel_size > 1:
            # Refuses what does not split over the ranks, before starting any.
            workers = TpWorkers.start(config, rank_agent)
        try:
            parts = build_parts(config, wrap_attention, None if workers is None else workers.tp)
            executor = parts.executor
            if workers is not None:
                executor = workers.leader_executor(parts.executor)
        except BaseException:
            if workers is not None:
                workers.stop()
            raise
        kv_cache, model = parts.kv_cache, parts.model
        pool = BlockPool(kv_cache.num_blocks)
        proposer = build_proposer(
            config,
            (parts.model_config, model),
            parts.draft,
            kv_cache.num_blocks,
            parts.max_model_len,
            parts.proposer_embedding,
        )
        sched_config = SchedulerConfig(
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.num_speculative_tokens,
            # A proposer drafting ahead writes up to k - 1 positions past the accepted ones.
            draft_lookahead=config.num_speculative_tokens - 1
            if hasattr(proposer, "draft_ahead")
            else 0,
        )
        prefix_cache = None
        if config.enable_prefix_caching:
            with_proposer = proposer_cache_config(config) is not None
            prefix_cache = PrefixCache(pool, config.block_size, with_proposer)
        # EngineConfig allows async scheduling by method; the proposer built is what acts.
        method = None if config.speculative_config is None else config.speculative_config.method
        assert hasattr(proposer, "draft_ahead") == (method in DRAFTS_AHEAD), method
        # Verifications are planned ahead from drafts made on the device (one device only).
        verifies_ahead = hasattr(proposer, "ahead_of") and workers is None
        async_scheduling = config.async_scheduling
        if async_scheduling is None:
            async_scheduling = executor.graphs is not None and (
                config.speculative_config is None or verifies_ahead
            )
        return cls(
            config=config,
            model_config=parts.model_config,
            kv_cache=kv_cache,
            pool=pool,
            scheduler=Scheduler(sched_config, pool, prefix_cache),
            runner=ModelRunner(
                executor, Sampler(config.seed), config.max_num_seqs, acceptance_curve(config)
            ),
            max_model_len=parts.max_model_len,
            async_scheduling=async_scheduling,
            grammars=GrammarCompiler(config.model, parts.model_config.vocab_size),
            proposer=proposer,
            tp_workers=workers,
            verifies_ahead=verifies_ahead,
        )

    def check_ranks(self) -> None:
        """RuntimeError if a tensor-parallel rank has exited: the engine cannot step again."""
        if self.tp_workers is not None:
            self.tp_workers.check_alive()

    def close(self) -> None:
        """Stops the tensor-parallel ranks, if any (the engine cannot step after)."""
        if self.tp_workers is not None:
            self.tp_workers.stop()
            self.tp_workers = None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def has_step_in_flight(self) -> bool:
        """Whether a step launched ahead (async scheduling) waits for the next `step`."""
        return self._in_flight is not None

    def new_sequence(
        self,
        seq_id: str,
        prompt_ids: Seq[int],
        sampling: SamplingParams,
        stop: StopConditions,
        grammar: Grammar | None = None,
    ) -> Sequence:
        """A sequence bound to this engine's model (EOS ids, context length, device), whose
        output `grammar` constrains when given."""
        if seq_id in self.sequences:
            raise ValueError(f"request_id: {seq_id!r} is already live")
        vocab = self.model_config.vocab_size
        if prompt_ids and not (min(prompt_ids) >= 0 and max(prompt_ids) < vocab):
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        if problem := vocabulary_problem(sampling.logit_bias, sampling.allowed_token_ids, vocab):
            raise ValueError(problem)
        seq = Sequence(
            seq_id, prompt_ids, sampling, stop, self.model_config.eos_token_ids, self.max_model_len
        )
        if sampling.seed is not None:
            seq.generator = torch.Generator(device=self.kv_cache.storage.device)
            seq.generator.manual_seed(sampling.seed)
        if grammar is not None:
            if grammar.vocab_size != vocab:
                raise ValueError(
                    f"structured_output: compiled for {grammar.vocab_size} tokens, the model "
                    f"has {vocab}"
                )
            # Its stop tokens as vLLM's: EOS (ignore_eos or not) and the request's stop ids.
            seq.grammar = grammar.matcher((*self.model_config.eos_token_ids, *stop.stop_token_ids))
        return seq

    def new_choices(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        sampling: SamplingParams,
        stop: StopConditions,
        n: int,
        grammar: Grammar | None = None,
    ) -> list[Sequence]:
        """The n choices of one request, `new_sequence`s with ids f"{request_id}#{i}"; choice i
        samples with seed + i (mod 2**64) when `sampling` has a seed, as vLLM's n does, and has
        a grammar matcher of its own. ValueError for n outside [1, MAX_N]."""
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n: {n} choices, not in [1, {MAX_N}]")
        # NOTE: a suffix on every id, choice 0's included, keeps ids distinct across requests:
        # with none on choice 0, request "x#1" would collide with choice 1 of "x".
        return [
            self.new_sequence(
                f"{request_id}#{i}", prompt_ids, sampling.for_choice(i), stop, grammar
            )
            for i in range(n)
        ]

    def add_request(
        self,
        seq_id: str,
        prompt_ids: Seq[int],
        sampling: SamplingParams,
        stop: StopConditions,
        grammar: Grammar | None = None,
    ) -> Sequence:
        return self.add_sequence(self.new_sequence(seq_id, prompt_ids, sampling, stop, grammar))

    def add_sequence(self, seq: Sequence) -> Sequence:
        """Admits a `new_sequence` (or one of `new_choices`) for a whole prefill."""
        self.scheduler.add(seq)
        self.sequences[seq.seq_id] = seq
        return seq

    @property
    def proposer_cache(self) -> KVCache | None:
        """The speculative proposer's own KV cache (a draft model's, the MTP layers'), addressed
        by the model's block ids; None without one."""
        return None if self.proposer is None else self.proposer.kv_cache

    def add_prefilled(self, seq: Sequence, block_ids: list[int], first_token: int) -> bool:
        """Admits a sequence whose prompt KV is already in `block_ids` (taken over by the
        engine; none: the prompt is recomputed), and so is the proposer's, if it keeps a cache
        (a prefill sends both: prefill/engine_layout.py). Returns False if first_token already
        finished it."""
        if block_ids and self.proposer_cache is not None:
            seq.num_draft_computed = seq.num_prompt_tokens
        if self.scheduler.add_prefilled(seq, block_ids, first_token):
            self.sequences[seq.seq_id] = seq
            return True
        return False

    def add_prefilled_choices(
        self, seqs: Seq[Sequence], block_ids: list[int], first_tokens: Seq[int]
    ) -> list[bool]:
        """Admits the choices of one prompt (see `new_choices`), whose prompt KV is in
        `block_ids`, each with its own first token. Choice 0 takes the blocks over (as
        `add_prefilled`); every other one shares the prompt's full blocks and gets a copy of a
        partial last block, or, when no block is free for that copy, recomputes its prompt (as a
        preempted sequence does). Returns, per choice, False if its first token finished it."""
        assert len(seqs) == len(first_tokens) >= 1
        # Shared and copied before choice 0 is admitted: a first token that finishes it at
        # once frees its blocks.
        num_tokens = seqs[0].num_prompt_tokens
        caches = _Caches(self.runner.executor, self.proposer_cache)
        forks = fork_blocks(self.pool, caches, block_ids, num_tokens, len(seqs) - 1)
        owned = [list(block_ids), *(fork or [] for fork in forks)]  # []: recomputes its prompt
        starts = zip(seqs, owned, first_tokens, strict=True)
        return [self.add_prefilled(seq, ids, token) for seq, ids, token in starts]

    def fill_proposer(self, finished: Seq[tuple[Sequence, list[int]]]) -> None:
        """Writes the proposer's KV of each finished sequence's positions before its last
        token (Proposer.fill_prompt) into `blocks`, the blocks it held, which the caller keeps
        (a prefill sends them with the model's KV). Nothing for a proposer without a cache."""
        if self.proposer_cache is None or not finished:
            return
        seqs = [seq for seq, _ in finished]
        for seq, blocks in finished:  # a finished sequence has given its blocks back
            seq.block_ids = blocks
        try:
            self.proposer.fill_prompt(seqs)
        finally:
            for seq in seqs:
                seq.block_ids = []

    def abort(self, seq_id: str) -> bool:
        return bool(self.abort_all([seq_id]))

    def abort_all(self, seq_ids: Seq[str]) -> list[str]:
        """Aborts those of `seq_ids` not finished yet, together; returns their ids."""
        for seq_id in seq_ids:
            self.sequences.pop(seq_id, None)
        aborted = [seq.seq_id for seq in self.scheduler.abort(seq_ids)]
        self._settle_idle_step()
        return aborted

    def step(self, before_run: Callable[[StepPlan], bool] | None = None) -> list[StepOutput]:
        """Runs one forward; returns the token each sampling sequence generated (with its
        log-probabilities, for a sequence that asks). `before_run` sees the plan first (the
        prefill server arms its per-layer KV sends with it; it turns async scheduling off for
        the step, since the caller acts on the plan once it returns) and returns whether the
        step must run eagerly: the hooks of its layers' Python code (the per-layer sends) run
        in an eager forward, never in a CUDA graph's replay.

        With async scheduling, the decode step after this one is launched before this one's
        tokens are read: the call returns with it running, and the next call returns its
        tokens."""
        try:
            return self._step(before_run)
        except RuntimeError as error:
            if self.tp_workers is not None:  # a collective failed: a rank that exited says why
                self.tp_workers.raise_if_one_exits(error)
            raise

    def _step(self, before_run: Callable[[StepPlan], bool] | None) -> list[StepOutput]:
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            plan = self.scheduler.schedule()
            if plan is None:
                return []
            eager = before_run is not None and bool(before_run(plan))
            launched = self._launch(self._with_drafts(plan), eager=eager)
        if self.async_scheduling and before_run is None:
            self._in_flight = self._launch_ahead(launched)
        sampled, logprobs = launched.result(), launched.logprobs()
        for seq_id, computed in launched.prompt_logprobs.items():
            if (seq := self.sequences.get(seq_id)) is not None:
                seq.prompt_logprobs.extend(computed.entries())
        accepted = launched.accepted()
        before = {item.seq.seq_id: item.seq.num_tokens for item in launched.plan.scheduled}
        finished = {s.seq_id for s in self.scheduler.update(launched.plan, sampled, accepted)}
        self.spec_stats.record_step(launched.plan, accepted, self.config.num_speculative_tokens)
        record = getattr(self.proposer, "record", None)  # a hidden-state proposer's (MTP, EAGLE-3)
        if record is not None:
            record(launched.plan, launched.hidden, accepted)
        ahead = self._in_flight
        if ahead is not None and ahead.plan.shifted:  # now that its offsets are known here
            ahead.plan = self.scheduler.resolve(ahead.plan, accepted, ahead.fed_drafts.drafts())
        outputs = []
        for seq_id in sampled:
            seq = self.sequences.get(seq_id)
            if seq is None:
                continue  # aborted, or finished by the step before: the token is thrown away
            reason = seq.finish_reason if seq_id in finished else None
            # Accepted drafts, then the sampled token (fewer when one of them finished it).
            new = seq.token_ids[before[seq_id] :]
            token_logprobs = logprobs.get(seq_id) or [None] * len(new)
            # Its first token carries the prompt's log-probabilities, if it asked: all in now.
            first = seq.num_prompt_tokens - before[seq_id]  # that token's place in `new`
            prompt = None
            if seq.sampling.prompt_logprobs is not None and 0 <= first < len(new):
                prompt = tuple(seq.prompt_logprobs)
            for i, (token, lp) in enumerate(zip(new, token_logprobs, strict=False)):
                last = i == len(new) - 1
                outputs.append(StepOutput(seq_id, token, reason if last else None, lp,
                                          prompt if i == first else None))  # fmt: skip
            if reason is not None:
                del self.sequences[seq_id]
        self._settle_idle_step()
        return outputs

    def _launch(self, plan: StepPlan, **kwargs) -> LaunchedStep:
        """runner.launch; then a proposer that drafts ahead (MTP's, EAGLE-3's) drafts the next
        step from its results on the device."""
        launched = self.runner.launch(plan, **kwargs)
        draft_ahead = getattr(self.proposer, "draft_ahead", None)
        if draft_ahead is not None:
            draft_ahead(launched)
        return launched

    def _launch_ahead(self, launched: LaunchedStep) -> LaunchedStep | None:
        """The step after `launched`, launched before it is read, when it can be planned so
        (Scheduler.schedule_ahead): after a verification, the next one fed the drafts made
        ahead of it, if its rows fit the verification graphs (where there are graphs)."""
        drafts = None
        if launched.verified is not None:
            drafts = self.proposer.ahead_of(launched) if self.verifies_ahead else None
            if drafts is None:
                return None
            graphs = self.runner.verify_graphs
            if graphs is not None and sum(1 + n for n in drafts.depths.values()) > graphs.max_batch:
                return None
        ahead = self.scheduler.schedule_ahead(launched.plan, drafts and drafts.depths)
        if ahead is None:
            return None
        return self._launch(ahead, feed=launched, drafts=drafts)

    def _with_drafts(self, plan: StepPlan) -> StepPlan:
        """The plan with the proposer's drafts for the sequences it leaves room for."""
        items = [item for item in plan.scheduled if item.draft_room]
        if self.proposer is None or not items:
            return plan
        drafts = self.proposer.propose([i.seq for i in items], [i.draft_room for i in items])
        return plan.with_drafts(
            {item.seq.seq_id: d for item, d in zip(items, drafts, strict=True) if d}
        )

    def _settle_idle_step(self) -> None:
        """A step launched ahead whose sequences have all finished returns no token: it is
        waited for and updated now, so that the blocks it writes go back to the pool."""
        if self._in_flight is not None and self.scheduler.ahead_is_idle:
            launched, self._in_flight = self._in_flight, None
            launched.result()
            self.scheduler.update(launched.plan, {})

    def generate(
        self, prompts: Seq[Seq[int]], sampling: SamplingParams, stop: StopConditions
    ) -> list[list[int]]:
        """Runs prompts to completion together; returns each one's generated tokens."""
        seqs = [self.add_request(f"gen-{i}", p, sampling, stop) for i, p in enumerate(prompts)]
        while self.has_unfinished:
            self.step()
        return [seq.output_ids for seq in seqs]
