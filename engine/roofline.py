"""What a decode step must read, and how fast the device reads: the roofline engine.bench sets
its figures against.

A step's bytes are its weights (all but the embedding table, of which it reads one row per
token, and of a mixture-of-experts layer only the experts its tokens chose: `experts_hit`) plus
every sequence's KV; the bandwidth is that of a large read-only reduction, measured in the run.
"""

from __future__ import annotations

import torch

from engine.engine_config import DTYPES
from engine.llm_engine import LLMEngine
from engine.model import CausalLM
from engine.moe import Experts

__all__ = ["experts_hit", "parameter_bytes", "read_bandwidth", "weight_bytes_per_step"]


def read_bandwidth(device: str) -> float:
    """Bytes/s a large read-only reduction achieves: the best of 20 timed repeats after 20
    untimed ones (4 GiB, far past L2). The best, not a median: a repeat only ever runs slower
    than the memory allows (clocks still rising, other work), and a median of fewer repeats
    right after start-up moved by 4% between runs on one machine."""
    if not device.startswith("cuda"):
        return float("nan")
    x = torch.ones(2**30, dtype=torch.float32, device=device)
    for _ in range(20):
        x.sum()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x
    return 4 * 2**30 / min(times)


def parameter_bytes(engine: LLMEngine) -> int:
    """Every parameter's bytes, each tied tensor once: the model's size."""
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def weight_bytes_per_step(engine: LLMEngine, batch: int) -> int:
    """The weight bytes a decode step of `batch` sequences reads: all but the embedding table
    (one row per token) and, in mixture-of-experts layers, the routed experts no token chose."""
    model: CausalLM = engine.runner.model
    itemsize = DTYPES[engine.config.dtype].itemsize
    embed = model.model.embed_tokens.weight
    table = embed.numel() * itemsize
    # Untied: the table is only gathered (one row per token). Tied: the lm_head reads it all.
    unread = 0 if model.lm_head is None else table
    return (
        parameter_bytes(engine) - unread + batch * embed.shape[1] * itemsize - _unhit(engine, batch)
    )


def experts_hit(num_experts: int, per_token: int, batch: int) -> float:
    """Expected distinct experts that `batch` tokens choose, each `per_token` distinct ones, all
    experts equally likely: exact at batch 1; at larger batches random weights and random
    prompts route close to uniformly."""
    return num_experts * (1 - (1 - per_token / num_experts) ** batch)


def _unhit(engine: LLMEngine, batch: int) -> int:
    """The bytes of routed experts a step of `batch` tokens leaves unread (expected)."""
    moe = engine.model_config.moe
    if moe is None:
        return 0
    stacks = [m for m in engine.runner.model.modules() if isinstance(m, Experts)]
    # An expert's bytes in every sparse layer: its weights (fp8 ones with their scales).
    expert = sum(p.numel() * p.element_size() for m in stacks for p in m.parameters())
    expert /= moe.n_routed_experts
    missed = moe.n_routed_experts - experts_hit(
        moe.n_routed_experts, moe.num_experts_per_tok, batch
    )
    return int(missed * expert)
