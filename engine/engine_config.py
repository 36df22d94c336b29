"""What an engine is built from: the model, device, dtype, KV cache size and scheduling limits
(`EngineConfig`, with its command-line flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from engine.scheduler import SchedulerConfig
from engine.speculative import DRAFTS_AHEAD, SpeculativeConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# KV cache element types besides "auto" (the model's dtype), by vLLM's names: e4m3 with one
# scale for the whole cache, KV_SCALE, as vLLM's `fp8` without calibrated scales.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
LOAD_FORMATS = ("auto", "dummy")
KV_SCALE = 1.0  # an fp8 cache's stored value times KV_SCALE is the value


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """A Hugging Face folder (config.json + safetensors), or `random:<preset>` (e.g.
    `random:llama3-8b`) for random weights of a named shape."""
    device: str = "cpu"
    """"cpu" or "cuda" (or "cuda:N")."""
    dtype: str = "bfloat16"
    """Weights and KV cache: bfloat16, float16 or float32."""
    block_size: int = 64
    """Tokens per KV block."""
    kv_cache_gb: float = 1.0
    """KV cache size in GiB (every layer's K and V, or MLA latent)."""
    max_model_len: int | None = None
    """Context length limit; default: the model's max_position_embeddings."""
    max_num_seqs: int = 256
    """Sequences in one forward at most."""
    max_num_batched_tokens: int = 2048
    """Tokens in one forward at most (longer prompts are prefilled in chunks)."""
    seed: int = 0
    """Seed of random weights and of unseeded sampling."""
    enforce_eager: bool = False
    """On CUDA: no CUDA graphs and no compiled (fused) elementwise ops."""
    kv_cache_dtype: str = "auto"
    """The KV cache's elements: "auto" (dtype), or "fp8" / "fp8_e4m3" (e4m3 with the per-tensor
    scale KV_SCALE; values beyond +-448 saturate), written and read converted."""
    async_scheduling: bool | None = None
    """Launch each decode step before the host has read the tokens of the one before it, so
    that scheduling and output processing overlap the device's work. A sequence that stops on
    a token (EOS, a stop id) then costs one more row, thrown away, in the step already launched;
    the rest of the batch goes on. Steps run one at a time while a sequence samples with
    penalties or under a grammar (both need the last token). None: on with CUDA graphs, where
    it overlaps; off elsewhere (CPU runs each step before returning). With speculative
    decoding, for the proposers that draft on the device (mtp, eagle3): each verification
    launched before the one before it is read, fed the drafts made from its results there;
    not with ngram or draft_model (their drafts follow from the tokens on the host)."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (engine/speculative.py): None, or its method and depth."""
    benchmark_mode: bool = False
    """Allows what only a benchmark may do: simulated draft acceptance (output tokens are then
    not the model's)."""
    load_format: str = "auto"
    """"auto": a folder's weights from its safetensors; "dummy": random weights of the folder's
    config.json (as vLLM's `--load-format dummy`: a real model's shape and tokenizer, no
    checkpoint). A `random:<preset>` model is always random."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (engine/tensor_parallel.py), one process each: this one is
    rank 0; on CUDA rank r runs on the device r past `device`'s. kv_cache_gb is per rank."""
    enable_prefix_caching: bool = False
    """Sequences start with the KV of the full blocks their tokens share with blocks computed
    before, kept until their blocks are needed (engine/prefix_cache.py)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: {self.device!r} must be cpu or cuda[:N]")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of auto, "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format: {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}"
            )
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb: {self.kv_cache_gb} must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: {self.max_model_len} must be at least 2")
        SchedulerConfig(self.block_size, self.max_num_seqs, self.max_num_batched_tokens)
        spec = self.speculative_config
        if spec is not None and spec.method not in DRAFTS_AHEAD and self.async_scheduling:
            raise ValueError(
                f"async_scheduling: not with speculative_config method {spec.method} (its "
                "drafts follow from the last step's tokens on the host); leave it unset"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size: {self.tensor_parallel_size} must be at least 1"
            )
        if spec is not None and spec.acceptance_curve is not None and not self.benchmark_mode:
            raise ValueError(
                "speculative_config.acceptance_curve: simulated acceptance returns tokens that "
                "are not the model's; it runs only in benchmark mode (--benchmark-mode)"
            )

    @property
    def random_weights(self) -> bool:
        """Whether the weights are drawn (seeded) instead of read from a checkpoint."""
        return self.model.startswith("random:") or self.load_format == "dummy"

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's torch dtype."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) or DTYPES[self.dtype]

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs: on CUDA, unless enforce_eager."""
        return self.device.startswith("cuda") and not self.enforce_eager

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--model",
            required=True,
            help="HF folder, or random:<preset> (tiny, llama3-8b, qwen3-8b, smollm2-135m, "
            "deepseek-tiny)",
        )
        parser.add_argument(
            "--load-format",
            default="auto",
            choices=LOAD_FORMATS,
            help="dummy: random weights of the folder's config.json (its shape and tokenizer)",
        )
        parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
        parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
        parser.add_argument(
            "--kv-cache-dtype",
            default="auto",
            choices=["auto", *KV_CACHE_DTYPES],
            help="KV cache elements: auto (--dtype), or fp8 (e4m3, scale 1.0)",
        )
        parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
        parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size in GiB")
        parser.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="context length limit (default: the model's)",
        )
        parser.add_argument(
            "--max-num-seqs", type=int, default=256, help="sequences per forward at most"
        )
        parser.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=2048,
            help="tokens per forward at most (prompts are chunked)",
        )
        parser.add_argument(
            "--seed", type=int, default=0, help="seed of random weights and unseeded sampling"
        )
        parser.add_argument(
            "--enforce-eager", action="store_true", help="CUDA: no CUDA graphs, no fused ops"
        )
        parser.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="launch each decode step before reading the last one's tokens "
            "(default: on with CUDA graphs, off with speculative decoding)",
        )
        parser.add_argument(
            "--speculative-config",
            type=_speculative_config,
            default=None,
            help='speculative decoding, as vLLM\'s: JSON, e.g. {"method": "ngram", '
            '"num_speculative_tokens": 3} or {"method": "draft_model", "model": PATH, '
            '"num_speculative_tokens": 3}',
        )
        parser.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=1,
            help="ranks (processes, one GPU each on CUDA) the model is split over",
        )
        parser.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="reuse the KV of full blocks a prompt shares with earlier ones (as vLLM's)",
        )
        parser.add_argument(
            "--benchmark-mode",
            action="store_true",
            help="allow simulated draft acceptance (speculative_config.acceptance_curve)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(
            model=args.model,
            load_format=args.load_format,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            kv_cache_gb=args.kv_cache_gb,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            speculative_config=args.speculative_config,
            benchmark_mode=args.benchmark_mode,
            enable_prefix_caching=args.enable_prefix_caching,
            tensor_parallel_size=args.tensor_parallel_size,
        )


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
