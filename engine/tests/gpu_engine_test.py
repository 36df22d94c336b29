"""The CUDA path (Triton attention, CUDA graphs) against the CPU path, token for token: the
Llama family's in float32 and in fp8 weights (the fp8 GEMV and GEMM), and the DeepSeek-V3
family's (Triton MLA decode and fused MoE); an fp8 KV cache through CUDA graphs.

Tagged `gpu` in Bazel: runs only with `./bazelw test --config=gpu`, or on the GPU machine with
`PYTHONPATH=.devicepack:. python3 -m pytest engine/tests/gpu_engine_test.py`.
"""

import json

import pytest
import torch

from engine.cuda_graphs import MAX_HOST_BUFFERS, StepInputs
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.speculative import SpeculativeConfig

PROMPTS = [[5, 17, 3], list(range(1, 40)), [9] * 70, list(range(100, 230, 3)), [1], [2, 4, 8, 16]]


def _engines(model="random:tiny", **overrides):
    base = dict(model=model, dtype="float32", block_size=16, kv_cache_gb=0.05)
    cpu = LLMEngine.build(EngineConfig(**base, device="cpu"))
    gpu = LLMEngine.build(EngineConfig(**base, device="cuda", **overrides))
    with torch.no_grad():
        # Same weights on both (random init differs per device); in place, so the captured
        # CUDA graphs keep pointing at them.
        for src, dst in zip(
            cpu.runner.model.parameters(), gpu.runner.model.parameters(), strict=True
        ):
            dst.copy_(src)
    return cpu, gpu


def _decode(engine, stops):
    seqs = [
        engine.add_request(f"r{i}", p, SamplingParams(), stop)
        for i, (p, stop) in enumerate(zip(PROMPTS, stops, strict=True))
    ]
    ahead = missed = steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        ahead += engine.has_step_in_flight
        # A step after the first (prefill) that leaves the batch going but no step running.
        missed += steps > 1 and engine.has_unfinished and not engine.has_step_in_flight
    assert engine.pool.num_free == engine.pool.num_total
    return [s.output_ids for s in seqs], ahead, missed


# (enforce_eager, async_scheduling): graphs with async scheduling (the default), graphs
# without, and eager CUDA steps fed the tokens before them on the device.
# tiny-fp8's 48-column blocks take the fp8 GEMM at every batch size; tiny-fp8-b32's the GEMV;
# deepseek-tiny-fp8's experts the fp8 expert GEMVs (one token) and tiles (prefill, batches).
MODELS = [
    "random:tiny",
    "random:tiny-fp8",
    "random:tiny-fp8-b32",
    "random:deepseek-tiny",
    "random:deepseek-tiny-fp8",
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    "enforce_eager, async_scheduling", [(False, None), (False, False), (True, True)]
)
def test_greedy_tokens_equal_cpu_path(model, enforce_eager, async_scheduling):
    cpu, gpu = _engines(model, enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    assert (gpu.runner.graphs is None) == enforce_eager
    assert gpu.async_scheduling == (async_scheduling is not False)
    stops = [StopConditions(max_tokens=24 - 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    expected, _, _ = _decode(cpu, stops)
    outputs, ahead, missed = _decode(gpu, stops)
    assert outputs == expected
    assert (ahead > 0) == gpu.async_scheduling
    # Sequences leave by length at different steps; the step ahead goes on without them.
    assert missed == 0 or not gpu.async_scheduling


def test_async_steps_stop_on_stop_ids_like_the_cpu_path():
    """Stop ids end sequences while the step after is already on the device: the tokens that
    step sampled for them are dropped, and the rest of the batch goes on unchanged."""
    cpu, gpu = _engines()
    free = [StopConditions(max_tokens=20, ignore_eos=True)] * len(PROMPTS)
    full, _, _ = _decode(cpu, free)
    # Each sequence stops at its own 4th + i-th token (or runs to 20, where a stop id
    # appears earlier in it).
    stops = [
        StopConditions(max_tokens=20, ignore_eos=True, stop_token_ids=(out[min(3 + i, 19)],))
        for i, out in enumerate(full)
    ]
    expected, _, _ = _decode(cpu, stops)
    outputs, ahead, _ = _decode(gpu, stops)
    assert outputs == expected and ahead > 0
    assert any(len(out) < 20 for out in expected)


def test_graph_batches_pad_without_touching_live_blocks():
    """5 sequences replay the 8-row graph: the 3 padded rows must leave every live KV intact,
    so decoding them again alone gives the same tokens."""
    _, gpu = _engines()
    stop = StopConditions(max_tokens=12, ignore_eos=True)
    together = gpu.generate(PROMPTS[:5], SamplingParams(), stop)
    alone = [gpu.generate([p], SamplingParams(), stop)[0] for p in PROMPTS[:5]]
    assert together == alone
    assert 8 in gpu.runner.graphs.buckets


def test_logprobs_equal_cpu_path():
    """Graph replays with async scheduling, every asking row's logprobs back through pinned
    memory: equal to the CPU's, rows that did not ask get none. A sampled row (its own random
    stream on each device, so compared with nothing) sends the batch through the sampler for
    its first 4 steps; the graph's own argmax serves it after."""
    cpu, gpu = _engines()
    kinds = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)]
    params = [kinds[i % 3] for i in range(len(PROMPTS) - 1)]
    params.append(SamplingParams(temperature=1.0, seed=1, logprobs=2))

    def run(engine):
        for i, (prompt, sampling) in enumerate(zip(PROMPTS, params, strict=True)):
            stop = StopConditions(max_tokens=10 if sampling.greedy else 4, ignore_eos=True)
            engine.add_request(f"r{i}", prompt, sampling, stop)
        outputs = {f"r{i}": [] for i in range(len(PROMPTS))}
        while engine.has_unfinished:
            for out in engine.step():
                outputs[out.seq_id].append(out)
        return list(outputs.values())

    expected, got = run(cpu), run(gpu)
    for sampling, e_outs, g_outs in zip(params, expected, got, strict=True):
        for e, g in zip(e_outs, g_outs, strict=True):
            if sampling.logprobs is None:
                assert e.logprobs is None and g.logprobs is None
            elif not sampling.greedy:
                assert len(g.logprobs.top_token_ids) == 2
                assert g.logprobs.logprob <= g.logprobs.top_logprobs[0]
            else:
                assert g.token_id == e.token_id
                assert len(g.logprobs.top_token_ids) == sampling.logprobs
                assert g.logprobs.logprob == pytest.approx(e.logprobs.logprob, abs=1e-4)
                expected_top = pytest.approx(e.logprobs.top_logprobs, abs=1e-4)
                assert g.logprobs.top_logprobs == expected_top


@pytest.mark.parametrize("model", ["random:tiny", "random:deepseek-tiny"])
def test_fp8_kv_cache_in_cuda_graphs_equals_eager_steps(model):
    """An e4m3 cache (K and V, or MLA's latent rows) written and read by the decode kernels
    inside captured graphs with async scheduling gives the tokens eager steps give. (Not the CPU
    path's: that one rounds toward zero as vLLM's CPU kernels do, CUDA to nearest as vLLM's CUDA
    kernels do.)"""
    _, graphs = _engines(model, kv_cache_dtype="fp8")
    _, eager = _engines(model, kv_cache_dtype="fp8", enforce_eager=True)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    assert graphs.config.kv_dtype == torch.float8_e4m3fn
    stops = [StopConditions(max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    expected, _, _ = _decode(eager, stops)
    outputs, _, _ = _decode(graphs, stops)
    assert outputs == expected


SPECULATIVE = [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, "random:tiny"),
    ({"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 2}, "random:tiny"),
    ({"method": "mtp", "num_speculative_tokens": 3}, "random:deepseek-tiny"),
    (
        {"method": "eagle3", "model": "random:eagle3-tiny", "num_speculative_tokens": 3},
        "random:tiny-8l",
    ),
]


@pytest.mark.parametrize(
    ("spec", "model"), SPECULATIVE, ids=["ngram", "draft_model", "mtp", "eagle3"]
)
def test_speculative_decoding_in_graphs_equals_the_cpu_path(spec, model):
    """Drafts verified in CUDA graphs (a row per fed token, K/V written before attending), a
    draft model's catch-up and steps in graphs of its own, MTP layers on the MLA kernels, an
    EAGLE-3 head fed the target's streams (kept by the target's graphs too): greedy tokens
    equal the CPU engine's without speculation."""
    config = SpeculativeConfig.from_json(json.dumps(spec))
    cpu, gpu = _engines(model, speculative_config=config)
    replays = {"verify": 0, "catch_up": 0}
    graphs = {"verify": gpu.runner.verify_graphs}
    if config.method == "draft_model":
        graphs["catch_up"] = gpu.proposer.catch_up_graphs
    elif config.method in ("mtp", "eagle3"):  # every forward, the catch-up's and each draft's
        graphs["catch_up"] = gpu.proposer.graphs[0]
    for name, graph in graphs.items():
        run = graph.run

        def counted(*args, _run=run, _name=name, **kwargs):
            replays[_name] += 1
            return _run(*args, **kwargs)

        graph.run = counted
    stops = [StopConditions(max_tokens=24 - 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    expected, _, _ = _decode(cpu, stops)
    outputs, _, _ = _decode(gpu, stops)
    assert outputs == expected
    assert gpu.spec_stats.num_drafts > 0 and replays["verify"] > 0
    assert replays["catch_up"] > 0 or config.method == "ngram"


@pytest.mark.parametrize(("spec", "model"), SPECULATIVE[2:], ids=["mtp", "eagle3"])
def test_drafts_and_verifications_made_ahead_in_graphs_equal_those_made_after_reading(spec, model):
    """MTP layers and EAGLE-3 heads draft each step's successor in their CUDA graphs as soon as
    the step is launched, the rows past the accepted drafts shifted on the device: every
    proposal equals the one made after the host has read the step. With async scheduling the
    next verification is launched on those drafts too, its inputs shifted on the device:
    output and acceptance unchanged. Drafts are accepted as a curve draws (0 to 3 a step), so
    every shift occurs."""
    config = SpeculativeConfig.from_json(
        json.dumps({**spec, "acceptance_curve": "mean-2.5-depth-3"})
    )
    stops = [StopConditions(max_tokens=40, ignore_eos=True) for _ in PROMPTS]
    runs, weights = [], None
    for mode in ("after", "drafts ahead", "verifications ahead"):
        engine = LLMEngine.build(
            EngineConfig(
                model=model, dtype="float32", block_size=16, kv_cache_gb=0.05, device="cuda",
                speculative_config=config, benchmark_mode=True,
                async_scheduling=mode == "verifications ahead",
            )
        )  # fmt: skip
        modules = [engine.runner.model, *engine.proposer.layers]
        params = [p for m in modules for p in m.parameters()]
        with torch.no_grad():  # the same weights in all (in place: the graphs point at them)
            for dst, src in zip(params, weights or params, strict=True):
                dst.copy_(src)
        weights = params
        proposer, runner, proposals, counts = engine.proposer, engine.runner, [], [0, 0]
        propose, draft_ahead, launch = proposer.propose, proposer.draft_ahead, runner.launch

        def spy(seqs, rooms, propose=propose, proposals=proposals):
            drafts = propose(seqs, rooms)
            proposals.append({s.seq_id: d for s, d in zip(seqs, drafts, strict=True)})
            return drafts

        def counted(step, draft_ahead=draft_ahead, counts=counts, p=proposer, on=mode != "after"):
            if on:
                draft_ahead(step)
                counts[0] += p.ahead_of(step) is not None

        def launched(plan, *args, launch=launch, counts=counts, **kwargs):
            counts[1] += plan.shifted
            return launch(plan, *args, **kwargs)

        proposer.propose, proposer.draft_ahead, runner.launch = spy, counted, launched
        outputs, _, _ = _decode(engine, stops)
        runs.append((outputs, proposals, counts, engine.spec_stats))
    (outputs, proposals, _, stats), (ahead_outputs, ahead_proposals, counts, ahead_stats) = runs[:2]
    assert ahead_proposals == proposals
    assert ahead_outputs == outputs and ahead_stats == stats
    assert counts[0] >= 5 and any(stats.accepted_per_position[1:])
    verified_outputs, _, counts, verified_stats = runs[2]
    assert verified_outputs == outputs and verified_stats == stats
    assert counts[1] >= 5


def test_step_inputs_uploaded_while_the_device_lags_each_land_as_written():
    """Uploads queued behind a long kernel (the host steps ahead of the device, as when a
    proposer drafts ahead): each copy carries its own step's inputs, none overwritten in its
    host buffer before the copy ran, past the most buffers kept too (the host then waits)."""
    inputs = StepInputs(bucket=2, max_blocks=2, padding_block=9, block_size=16, device="cuda")
    seen = []
    torch.cuda._sleep(200_000_000)  # tens of milliseconds: the copies queue behind it
    for step in range(MAX_HOST_BUFFERS + 3):
        inputs.upload([step, step + 100], [step, step + 1], [[1], [2]])
        seen.append(inputs.input_ids.clone())
    torch.cuda.synchronize()
    assert [s.tolist() for s in seen] == [[i, i + 100] for i in range(MAX_HOST_BUFFERS + 3)]
