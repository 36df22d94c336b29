"""Engine benchmark: decode and prefill throughput against the memory-bandwidth roofline.

For each (batch size, context length): `batch` random prompts of `context` tokens are prefilled,
then `decode_tokens` decode steps are timed through the engine's real step loop (scheduler,
CUDA graphs, sampling, host sync). The roofline of a decode step is the bytes it must read,
weights (all but the embedding table, of which it reads one row per token, and of a
mixture-of-experts layer only the experts its tokens chose: engine/roofline.py) plus every
sequence's KV, over the HBM read bandwidth measured in the same run. MBU (model bandwidth
utilization) is the usual looser count: every parameter's bytes, the embedding table whole,
plus the KV, over that same measured bandwidth (the published MBU figures divide by the
datasheet's bandwidth instead, which reads lower). `--peer hf` times Hugging Face
transformers `generate` on the very same weights in the same run. `--json-schema FILE` (or
`--grammar FILE`, EBNF) constrains every sequence to it (structured output): run with and
without it to get what the grammar masks cost a step (and the synchronous stepping they need).
`--variant model=random:llama3-8b-fp8,kv_cache_dtype=fp8` (repeatable) runs the same cases on
another engine in the same run, its configuration the base one with those fields replaced (one
engine in memory at a time); its rows' system column is the variant, or its label
(`--variant 'mtp-sim:speculative_config={...}'`). With speculative decoding a step yields up to
k + 1 tokens a sequence: decode tok/s and TPOT count tokens, the roofline stays the one-token
decode's (above 100% is speculation's gain), and `accept len` is the mean tokens per verified
proposal; `--benchmark-mode` lets a variant simulate acceptance from a committed curve
(engine/acceptance_curves.json) on random weights. `--prompt-file` (one JSON string per line)
decodes real text instead of random tokens, e.g. n-gram lookup's real acceptance on code edits
(the context column is then the prompts' mean length). `--profile-steps N` runs N more steps of
each case under torch.profiler and prints where a step's time goes, kernel by kernel
(engine/step_profile.py), its whole trace written beside --out.

    python -m engine.bench --model random:llama3-8b --device cuda --batch-sizes 1,64 \
        --context-lens 1024 --peer hf --out bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import hf_peer, step_profile
from engine.grammar import Grammar, GrammarCompiler, GrammarKind, GrammarSpec
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import read_model_config
from engine.roofline import parameter_bytes, read_bandwidth, weight_bytes_per_step
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.speculative import SpecStats, SpeculativeConfig


@dataclass(frozen=True)
class Result:
    system: str  # "tandem" or "hf"
    batch: int
    context: int
    decode_tok_s: float
    prefill_tok_s: float | None
    roofline_tok_s: float | None
    roofline_ratio: float | None
    mbu: float | None  # (all parameter bytes + KV bytes) per step / measured bandwidth / step
    peak_memory_gb: float | None
    tpot_ms: float | None = None  # decode seconds per token of one sequence
    acceptance_length: float | None = None  # speculative decoding: tokens per verified proposal
    profile: step_profile.StepProfile | None = None  # --profile-steps: after the timed steps


def bench_engine(
    engine: LLMEngine,
    batch: int,
    context: int,
    decode_tokens: int,
    bandwidth: float,
    grammar: Grammar | None = None,
    system: str = "tandem",
    texts: list[list[int]] | None = None,
    sampling: SamplingParams | None = None,
    profile_steps: int = 0,
    trace: Path | None = None,
) -> Result:
    """Prefills `batch` prompts, then times decode steps in which all of them decode (each
    constrained to `grammar` when given) until they have generated `decode_tokens` each on
    average (one a step, or with speculative decoding up to k + 1). The same prefill runs once
    untimed first: the first batches of a shape compile kernels. The roofline is the
    one-token-a-step decode's: with speculation, more than 100% of it is its gain. Then
    `profile_steps` more steps run under the profiler (engine/step_profile.py; the whole trace
    written to `trace`)."""
    rng = random.Random(batch * 1_000_003 + context)
    vocab = engine.model_config.vocab_size
    # Room for the decodes that run while later prompts are still prefilling, and the timed ones
    # (up to k + 1 tokens a step with speculative decoding).
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    if texts:  # real prompts, in turn
        prompts = [texts[i % len(texts)] for i in range(batch)]
        context = sum(map(len, prompts)) // batch
    prefill_steps = -(-batch * context // engine.config.max_num_batched_tokens) + 1
    per_step = engine.config.num_speculative_tokens + 1
    steps = decode_tokens + profile_steps
    stop = StopConditions(max_tokens=prefill_steps + per_step * steps + 2, ignore_eos=True)
    sampling = sampling or SamplingParams()
    _prefill(engine, prompts, stop, f"warm-up-b{batch}-c{context}", sampling, grammar)
    _abort_all(engine)
    prefill_s = _prefill(engine, prompts, stop, f"b{batch}-c{context}", sampling, grammar)
    # One step first: with async scheduling the step after each returned one is already
    # running, so the timing runs from one returned step to another, in that steady state.
    engine.step()
    kv_tokens = 0  # context tokens whose KV the timed steps read
    generated = steps = 0
    drafts_before = dataclasses.replace(engine.spec_stats)
    start = time.perf_counter()
    while generated < batch * decode_tokens:
        kv_tokens += sum(seq.num_tokens for seq in engine.sequences.values())
        generated += len(engine.step())
        steps += 1
        left = "a sequence left the batch during timing"
        if grammar is not None:
            left += " (its grammar completed: give a schema with longer outputs)"
        assert len(engine.sequences) == batch, left
    decode_s = time.perf_counter() - start
    acceptance = _acceptance_length(engine, drafts_before)
    profile = step_profile.profile_steps(engine, profile_steps, trace) if profile_steps else None
    _abort_all(engine)
    # One-token steps: as many as tokens per sequence, each reading the weights and the KV.
    one_token_steps = generated / batch
    kv_bytes = kv_tokens / steps * one_token_steps
    kv_bytes *= engine.model_config.kv_bytes_per_token(engine.config.kv_dtype)
    min_s = (weight_bytes_per_step(engine, batch) * one_token_steps + kv_bytes) / bandwidth
    mbu_s = (parameter_bytes(engine) * one_token_steps + kv_bytes) / bandwidth
    decode_tok_s = generated / decode_s
    cuda = engine.config.device.startswith("cuda")
    return Result(
        system=system,
        batch=batch,
        context=context,
        decode_tok_s=decode_tok_s,
        prefill_tok_s=batch * context / prefill_s,
        roofline_tok_s=generated / min_s if cuda else None,
        roofline_ratio=min_s / decode_s if cuda else None,
        mbu=mbu_s / decode_s if cuda else None,
        peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        tpot_ms=decode_s / one_token_steps * 1e3,
        acceptance_length=acceptance,
        profile=profile,
    )


def _acceptance_length(engine: LLMEngine, before: SpecStats) -> float | None:
    """Mean tokens per verified proposal over the timed steps; None without speculation."""
    if engine.config.speculative_config is None:
        return None
    stats = engine.spec_stats
    drafts = stats.num_drafts - before.num_drafts
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    return 1 + accepted / drafts if drafts else 1.0


def bench_hf(engine: LLMEngine, batch: int, context: int, decode_tokens: int) -> Result:
    """transformers on the engine's own weights (engine.hf_peer): decode tok/s only."""
    tok_s = hf_peer.decode_tok_s(engine, batch, context, decode_tokens)
    return Result("hf", batch, context, tok_s, None, None, None, None, None)


def _prefill(
    engine: LLMEngine,
    prompts: list[list[int]],
    stop: StopConditions,
    name: str,
    sampling: SamplingParams,
    grammar: Grammar | None = None,
) -> float:
    """Adds the prompts and steps until every sequence has its first token: the seconds taken."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, sampling, stop, grammar)
    _sync(engine)
    start = time.perf_counter()
    while any(seq.num_output_tokens == 0 for seq in engine.sequences.values()):
        engine.step()
    _sync(engine)
    return time.perf_counter() - start


def _abort_all(engine: LLMEngine) -> None:
    for seq_id in list(engine.sequences):
        engine.abort(seq_id)
    assert engine.pool.num_free == engine.pool.num_total


def _sync(engine: LLMEngine) -> None:
    if engine.config.device.startswith("cuda"):
        torch.cuda.synchronize()


def _table(results: list[Result], bandwidth: float) -> str:
    width = max(6, *(len(r.system) for r in results))
    lines = [
        f"HBM read bandwidth (measured): {bandwidth / 1e12:.2f} TB/s",
        f"{'system':<{width}} {'batch':>5} {'context':>7} {'decode tok/s':>12} "
        f"{'prefill tok/s':>13} {'roofline tok/s':>14} {'of roofline':>11} {'MBU':>6} "
        f"{'peak GiB':>8} {'TPOT ms':>7} {'accept len':>10}",
    ]
    for r in results:
        lines.append(
            f"{r.system:<{width}} {r.batch:>5} {r.context:>7} {r.decode_tok_s:>12.1f} "
            f"{_fmt(r.prefill_tok_s, '.0f'):>13} {_fmt(r.roofline_tok_s, '.1f'):>14} "
            f"{_fmt(r.roofline_ratio, '.1%'):>11} {_fmt(r.mbu, '.1%'):>6} "
            f"{_fmt(r.peak_memory_gb, '.1f'):>8} {_fmt(r.tpot_ms, '.2f'):>7} "
            f"{_fmt(r.acceptance_length, '.2f'):>10}"
        )
    return "\n".join(lines)


def variant_config(config: EngineConfig, spec: str) -> tuple[str, EngineConfig]:
    """(label, config with the fields of spec replaced): spec is "[label:]field=value,..."
    (label: the spec itself when not given), each value parsed as the field's current type;
    speculative_config's value is JSON, the rest of the spec. ValueError naming a field
    EngineConfig has not."""
    types = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
    fields = set(types)
    label, colon, rest = spec.partition(":")
    if not colon or "=" in label:
        label, rest = spec, spec
    changes: dict[str, object] = {}
    items = rest.split(",")
    while items:
        name, equals, text = items.pop(0).partition("=")
        if not equals or name not in fields:
            raise ValueError(f"--variant {spec!r}: {name!r} is not an EngineConfig field")
        current = getattr(config, name)
        if name == "speculative_config":
            changes[name] = SpeculativeConfig.from_json(",".join([text, *items]))
            items = []
        elif isinstance(current, bool) or types[name].startswith("bool"):  # bool | None too
            changes[name] = text.lower() in ("1", "true", "yes")
        elif isinstance(current, int | float):
            changes[name] = type(current)(text)
        else:
            changes[name] = text
    return label, dataclasses.replace(config, **changes)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated")
    parser.add_argument("--context-lens", default="1024", help="comma-separated prompt lengths")
    parser.add_argument("--decode-tokens", type=int, default=128, help="timed decode steps")
    parser.add_argument("--peer", choices=["none", "hf"], default="none")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="every request's (0: greedy)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's")
    parser.add_argument("--out", default="engine-bench.json", help="JSON results")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="another engine for the same cases, e.g. model=random:llama3-8b-fp8 or "
        "kv_cache_dtype=fp8 (EngineConfig fields, comma-separated; repeatable), optionally "
        'labelled: \'draft:speculative_config={"method": "draft_model", ...}\' (JSON, last)',
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each case's timed steps, this many more under torch.profiler: the time a "
        "step spends in each kernel, printed and in the JSON, the whole trace beside --out",
    )
    parser.add_argument(
        "--prompt-file",
        default=None,
        help="decode these prompts (one JSON string per line, tokenized by --model's "
        "tokenizer) instead of random tokens; --context-lens is then ignored",
    )
    parser.add_argument(
        "--json-schema",
        default=None,
        help="a JSON Schema file every sequence is constrained to (compact whitespace); its "
        "outputs must outlast the timed steps, e.g. a string with a large minLength",
    )
    parser.add_argument(
        "--grammar",
        default=None,
        help="instead: an EBNF grammar file (xgrammar's syntax, a `root` rule), e.g. "
        "`root ::= [a-z ] root`, whose outputs never end",
    )
    parser.add_argument(
        "--grammar-tokenizer",
        default=None,
        help="HF folder whose tokenizer the schema is compiled for (default: --model; a random "
        "model has none, and any tokenizer will do to time the masks)",
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.context_lens.split(",")]
    config = EngineConfig.from_cli_args(args)
    texts = _prompt_file(args.prompt_file, config.model) if args.prompt_file else None
    if texts:
        contexts = [0]  # each batch's prompts' mean length
    try:
        systems = [("tandem", config)] + [variant_config(config, v) for v in args.variant]
    except ValueError as e:
        parser.error(str(e))
    grammar = _grammar(args, config) if args.json_schema or args.grammar else None
    bandwidth = read_bandwidth(config.device)
    results = []
    for system, system_config in systems:
        engine = LLMEngine.build(system_config)
        for context in contexts:
            for batch in batches:
                results.append(
                    bench_engine(
                        engine,
                        batch,
                        context,
                        args.decode_tokens,
                        bandwidth,
                        grammar,
                        system,
                        texts,
                        SamplingParams(temperature=args.temperature, top_p=args.top_p),
                        args.profile_steps,
                        _trace_path(args.out, system, batch, context),
                    )
                )
                print(_table(results[-1:], bandwidth).splitlines()[-1], flush=True)
                if results[-1].profile is not None:
                    print(results[-1].profile.table(), flush=True)
                if args.peer == "hf" and system == "tandem":
                    results.append(bench_hf(engine, batch, context, args.decode_tokens))
                    print(_table(results[-1:], bandwidth).splitlines()[-1], flush=True)
        engine.close()  # its tensor-parallel ranks, if any
        del engine  # one engine in memory at a time
        gc.collect()
        if config.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(_table(results, bandwidth))
    payload = {
        "config": asdict(config),
        "variants": args.variant,
        "device_name": torch.cuda.get_device_name() if config.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "hbm_read_bytes_per_s": bandwidth,
        "json_schema": args.json_schema,
        "prompt_file": args.prompt_file,
        "grammar": args.grammar,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "results": [asdict(r) for r in results],
    }
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)


def _trace_path(out: str, system: str, batch: int, context: int) -> Path:
    """Where --profile-steps writes a case's trace: beside --out, named after the case."""
    label = re.sub(r"[^\w.-]+", "_", system)
    return Path(out).with_name(f"{Path(out).stem}-{label}-b{batch}-c{context}.trace.json.gz")


def _prompt_file(path: str, model: str) -> list[list[int]]:
    """The prompts of `path` (a JSON string per line), tokenized by `model`'s tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lines = Path(path).read_text().splitlines()
    return [tokenizer(json.loads(line))["input_ids"] for line in lines if line.strip()]


def _grammar(args: argparse.Namespace, config: EngineConfig) -> Grammar:
    """The --json-schema or --grammar every sequence is constrained to, compiled."""
    vocab_size = read_model_config(config).vocab_size
    compiler = GrammarCompiler(args.grammar_tokenizer or config.model, vocab_size)
    kind = GrammarKind.JSON_SCHEMA if args.json_schema else GrammarKind.GRAMMAR
    text = Path(args.json_schema or args.grammar).read_text()
    return compiler.compile(GrammarSpec(kind, text, kind is GrammarKind.JSON_SCHEMA))


if __name__ == "__main__":
    main()
