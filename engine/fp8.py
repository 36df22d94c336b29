"""FP8 weights: float8_e4m3fn matrices with per-block scales, as FP8 checkpoints ship them.

A checkpoint quantized with `quantization_config` {"quant_method": "fp8", "weight_block_size":
[bn, bk]} (DeepSeek-V3, GLM-5, Qwen3 FP8) stores each projection's weight W [N, K] as e4m3
values q with one float32 `weight_scale_inv` s per [bn, bk] block: W = q * s. Without
`weight_block_size` one scale covers the tensor (`weight_scale`, a scalar).

In memory a projection keeps q [N, K] and its scales expanded along rows, `weight_scale` [N,
ceil(K / bk)] float32: row r's scale for K block j, the scale of the block holding (r, j). Rows
are what projections fuse (q/k/v into qkv_proj, gate and up), and fused parts need not start on
a bn boundary (a 576-row latent projection after a 1,536-row one does not end on one), so
row-wise scales fuse by concatenation like the weights. They cost 4 / bk bytes per weight byte
(3% at bk = 128).

Compute takes an `Fp8Weight` where it would take a weight tensor; `dense` gives the matrix in a
compute dtype (the CPU path: correct, not fast).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's fp8 weights are scaled: per [block_n, block_k] block, or per tensor
    (both None)."""

    block_n: int | None
    block_k: int | None

    def __post_init__(self) -> None:
        if (self.block_n is None) != (self.block_k is None):
            raise ValueError("weight_block_size needs both sizes, or neither (per tensor)")
        for size in (self.block_n, self.block_k):
            if size is not None and (not isinstance(size, int) or size <= 0):
                raise ValueError(f"weight_block_size must be positive ints, got {size!r}")

    @property
    def scale_name(self) -> str:
        """The checkpoint's name of a weight's scale tensor."""
        return "weight_scale" if self.block_n is None else "weight_scale_inv"

    def k_blocks(self, in_features: int) -> int:
        """Scale columns of a matrix with in_features columns."""
        return 1 if self.block_k is None else -(-in_features // self.block_k)

    def expand_scale(self, scale: torch.Tensor, rows: int) -> torch.Tensor:
        """A checkpoint scale ([ceil(rows / bn), kb], or a per-tensor scalar) -> [rows, kb]."""
        if self.block_n is None:
            if scale.numel() != 1:
                raise ValueError(f"a per-tensor scale has one element, got {tuple(scale.shape)}")
            return scale.reshape(1, 1).expand(rows, 1)
        if scale.dim() != 2 or scale.shape[0] != -(-rows // self.block_n):
            raise ValueError(
                f"scale of shape {tuple(scale.shape)} does not cover {rows} rows in blocks of "
                f"{self.block_n}"
            )
        return scale.repeat_interleave(self.block_n, dim=0)[:rows]

    def matrix(self, weight: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
        """The Fp8Weight of an e4m3 weight [..., N, K] and its row-wise scales."""
        return Fp8Weight(weight, scale, self.block_k or weight.shape[-1])


def scheme_of(quantization_config: Mapping[str, Any] | None) -> Fp8Scheme | None:
    """The Fp8Scheme of a config.json's quantization_config (None if absent); ValueError for
    anything else, naming the field."""
    if quantization_config is None:
        return None
    q = quantization_config
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (fp8)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {q['fmt']!r} is not supported (e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme {q['activation_scheme']!r} is not supported "
            "(dynamic: no static input scales)"
        )
    skipped = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
    if any("lm_head" not in name for name in skipped):
        raise ValueError(
            f"quantization_config.modules_to_not_convert {skipped!r} is not supported (only "
            "lm_head may stay unquantized: every projection of the decoder layers is fp8)"
        )
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Scheme(None, None)
    if not isinstance(block, list | tuple) or len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size must be [n, k], got {block!r}")
    return Fp8Scheme(*block)


class Fp8Weight(NamedTuple):
    """An fp8 matrix as compute takes it (in place of a weight tensor)."""

    weight: torch.Tensor  # [..., N, K] float8_e4m3fn
    scale: torch.Tensor  # [..., N, ceil(K / block_k)] float32
    block_k: int  # columns a scale covers (K for a per-tensor scale)

    @property
    def shape(self) -> torch.Size:
        """The matrix's shape, as a weight tensor's: [..., N, K]."""
        return self.weight.shape

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """q * scale in float32, rounded once to dtype."""
        columns = self.weight.shape[-1]
        scale = self.scale.repeat_interleave(self.block_k, dim=-1)[..., :columns]
        return (self.weight.float() * scale).to(dtype)


Matrix = torch.Tensor | Fp8Weight
"""A projection's matrix as compute takes it: a weight tensor, or an fp8 one with its scales."""


def as_matrix(scheme: Fp8Scheme | None, weight: torch.Tensor, scale: torch.Tensor | None) -> Matrix:
    """A module's weight as compute takes it: the tensor itself without an Fp8Scheme, else
    the Fp8Weight of it and its row-wise `scale`."""
    return weight if scheme is None else scheme.matrix(weight, scale)


def expert(weight: Matrix, index: int) -> Matrix:
    """One matrix of a stack [experts, N, K] (tensor or fp8)."""
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(weight.weight[index], weight.scale[index], weight.block_k)
    return weight[index]


def dense(weight: Matrix, dtype: torch.dtype) -> torch.Tensor:
    """The matrix in a compute dtype: itself if it is a tensor already."""
    return weight.dense(dtype) if isinstance(weight, Fp8Weight) else weight


def quantize(w: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] e4m3, the checkpoint's scale: [ceil(N / bn), ceil(K / bk)], or a
    scalar per tensor), each block scaled so that its largest magnitude maps to FP8_MAX."""
    rows, columns = w.shape
    bn = rows if scheme.block_n is None else scheme.block_n
    bk = columns if scheme.block_k is None else scheme.block_k
    nb, kb = -(-rows // bn), -(-columns // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:rows, :columns] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [nb, kb]
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(FP8_DTYPE).view(nb * bn, kb * bk)
    q = q[:rows, :columns].contiguous()
    return q, scale.reshape(()) if scheme.block_n is None else scale
