"""Benchmarks an OpenAI-compatible server (tandem's router, vLLM, ...) under a synthetic load.

    ./bazelw run //tools:bench -- --base-url http://127.0.0.1:8000 --dataset random \
        --random-input-len 8192 --random-output-len 1024 --num-prompts 200 --max-concurrency 16 \
        --tokenizer DIR --result-json /tmp/bench.json --plot /tmp/bench.png
    ./bazelw run //tools:bench -- --base-url URL --dataset agentic --num-prompts 32 \
        --agentic-turns 10 --max-concurrency 8 --request-rate 2

Prints a table (TTFT, TPOT, ITL, E2E mean and percentiles, throughput, errors by kind); with
--result-json and --plot, also writes the results as JSON and the latency CDFs as a PNG.

A named scenario (tools/bench/scenarios.py) runs its concurrency sweep, one level after another,
and prints one row per level; --compare prints two such runs side by side:

    ./bazelw run //tools:bench -- --base-url URL --scenario 8k1k --tokenizer DIR \
        --result-json disaggregated.json
    ./bazelw run //tools:bench -- --base-url URL --scenario agentic --context 131072 ...
    ./bazelw run //tools:bench -- --compare aggregated.json disaggregated.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import httpx

from tools.bench import datasets, scenarios, server_phases
from tools.bench.config import BenchConfig
from tools.bench.progress import Progress
from tools.bench.report import plot_cdfs, records, summarize, table, write_json
from tools.bench.runner import Load, RunResult, run, warm_up


class ServerError(Exception):
    """The server cannot be benchmarked at all (unreachable, no models)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.splitlines()[0])
    BenchConfig.add_cli_args(parser)
    parser.add_argument("--scenario", choices=sorted(scenarios.SCENARIOS), default=None,
                        help="a named dataset shape and concurrency sweep")  # fmt: skip
    parser.add_argument("--concurrencies", default=None,
                        help="the scenario's levels instead of its own, e.g. 1,8")  # fmt: skip
    parser.add_argument("--context", type=int, default=32768,
                        help="agentic scenario: the last turn's context in tokens")  # fmt: skip
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                        help="two scenario runs' results side by side, and B / A")  # fmt: skip
    args = parser.parse_args(argv)
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    # NOTE: `bazel run` starts the binary in its runfiles tree; paths given are the user's.
    user_dir = Path(os.environ.get("BUILD_WORKING_DIRECTORY", "."))
    args.result_json = args.result_json and str(user_dir / args.result_json)
    args.plot = args.plot and str(user_dir / args.plot)
    if args.tokenizer and (user_dir / args.tokenizer).exists():  # else a Hugging Face hub id
        args.tokenizer = str(user_dir / args.tokenizer)
    if args.compare:
        runs = [json.loads((user_dir / path).read_text()) for path in args.compare]
        for path, run in zip(args.compare, runs, strict=True):
            if "levels" not in run:
                sys.exit(f"bench: --compare: {path} is not a scenario run's result (run it "
                         "with --scenario and --result-json)")  # fmt: skip
        print(scenarios.compare_table(*runs, *(Path(path).stem for path in args.compare)))
        return
    try:
        config = BenchConfig.from_cli_args(args)
        levels = args.concurrencies and [int(c) for c in args.concurrencies.split(",")]
        if args.scenario:
            sweep = scenarios.level_configs(config, args.scenario, levels, args.context)
    except ValueError as e:
        parser.error(str(e))
    if args.scenario:
        try:
            run_scenario(args.scenario, config, sweep)
        except ServerError as e:
            sys.exit(f"bench: {e}")
        return
    conversations = _dataset(config)
    try:
        model, result = asyncio.run(_bench(config, conversations))
    except ServerError as e:
        sys.exit(f"bench: {e}")
    planned = sum(len(c.turns) for c in conversations)
    summary = summarize(result, planned)
    print(f"{config.dataset} dataset, model {model} at {config.base_url}")
    print(table(summary))
    if config.result_json:
        write_json(Path(config.result_json), {**config.to_json(), "model": model}, summary,
                   result.results)  # fmt: skip
    if config.plot:
        rate = "unlimited" if config.request_rate == math.inf else f"{config.request_rate}/s"
        load = f"concurrency {config.max_concurrency or 'unlimited'}, rate {rate}"
        plot_cdfs(Path(config.plot), result.results, f"{config.dataset}, {model}, {load}")


def run_scenario(name: str, base: BenchConfig, sweep: list[BenchConfig], bench=None) -> list:
    """Each level in turn against the server (through `bench(config, conversations)`, by
    default the HTTP client); prints the rows so far after each, writes the JSON of all of them
    to base.result_json; returns the levels."""
    levels = []
    for config in sweep:
        conversations = _dataset(config)
        model, result = asyncio.run((bench or _bench)(config, conversations))
        summary = summarize(result, sum(len(c.turns) for c in conversations))
        levels.append({"concurrency": config.max_concurrency, "config": config.to_json(),
                       "summary": summary, "requests": records(result.results)})  # fmt: skip
        print(f"{name}, model {model} at {base.base_url}")
        print(scenarios.sweep_table(levels))
        if base.plot:
            path = Path(base.plot)
            title = f"{name}, {model}, concurrency {config.max_concurrency}"
            plot_cdfs(path.with_stem(f"{path.stem}-c{config.max_concurrency}"), result.results,
                      title)  # fmt: skip
    if base.result_json:
        payload = {"scenario": name, "model": model, "levels": levels}
        Path(base.result_json).write_text(json.dumps(payload, indent=2) + "\n")
    return levels


def _dataset(config: BenchConfig) -> list[datasets.Conversation]:
    if config.tokenizer:
        from transformers import AutoTokenizer  # slow to import: only when asked for

        source = datasets.TokenizerText(AutoTokenizer.from_pretrained(config.tokenizer))
    else:
        source = datasets.WordText()
    if config.dataset == "random":
        return datasets.random_dataset(source, config.num_prompts, config.random_input_len,
                                       config.random_output_len, config.seed)  # fmt: skip
    return datasets.agentic_dataset(source, config.num_prompts, config.agentic_turns,
                                    config.agentic_system_len, config.agentic_turn_len,
                                    config.agentic_output_len, config.seed)  # fmt: skip


async def _bench(config: BenchConfig, conversations: list) -> tuple[str, RunResult]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # Connections are pooled up to the concurrency: beyond it, httpx would queue requests itself.
    limits = httpx.Limits(max_connections=config.max_concurrency,
                          max_keepalive_connections=config.max_concurrency)  # fmt: skip
    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(config.timeout_s)) as http:  # fmt: skip
        model = config.model or await _first_model(http)
        fields = {"model": model, "temperature": config.temperature}
        if config.ignore_eos:
            fields["ignore_eos"] = True
        progress = Progress(sum(len(c.turns) for c in conversations))
        load = Load(config.max_concurrency, config.request_rate, config.seed)
        await warm_up(http, conversations, fields, config.num_warmups)
        before = await server_phases.read(http)
        result = await run(http, conversations, load, fields, progress)
        phases = server_phases.means_ms(before, await server_phases.read(http))
        progress.close()
    return model, dataclasses.replace(result, server_phases_ms=phases)


async def _first_model(http: httpx.AsyncClient) -> str:
    try:
        response = await http.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, LookupError) as e:
        url = str(http.base_url).rstrip("/") + "/v1/models"
        raise ServerError(f"cannot list the models at {url}: {e!r}") from e


if __name__ == "__main__":
    main()
