"""Writes an FP8 copy of a Hugging Face checkpoint, as FP8 checkpoints ship: every projection of
the decoder layers (attention's, the MLPs', each routed expert's) as e4m3 with a float32 scale
per block (`weight_scale_inv`, 128x128 by default) or per tensor (`weight_scale`), the rest
(embeddings, lm_head, norms, routers) as it is, and `quantization_config` in config.json.

    python -m tools.fp8_checkpoint SRC DST [--block 128 128 | --per-tensor]

The other files of SRC (tokenizer, generation config) are copied. tandem serves DST with its
fp8 path (engine.fp8); `python -m tools.fp8_quality` measures what the rounding costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from engine.fp8 import Fp8Scheme, quantize

# The projections FP8 checkpoints quantize (Llama's and DeepSeek's names).
PROJECTIONS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
})  # fmt: skip


def quantize_folder(src: Path, dst: Path, scheme: Fp8Scheme) -> int:
    """Writes DST from SRC (see the module docstring); returns the tensors quantized."""
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config") is not None:
        raise ValueError(f"{src} is quantized already: {config['quantization_config']}")
    dst.mkdir(parents=True, exist_ok=True)
    state, quantized = {}, 0
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no iteration)
                tensor = f.get_tensor(name)
                parts = name.split(".")
                if len(parts) > 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS:
                    state[name], state[f"{name[: -len('weight')]}{scheme.scale_name}"] = quantize(
                        tensor, scheme
                    )
                    quantized += 1
                else:
                    state[name] = tensor
    if not quantized:
        raise ValueError(f"{src}: no projection weights to quantize")
    save_file(state, dst / "model.safetensors")
    block = None if scheme.block_n is None else [scheme.block_n, scheme.block_k]
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": block,
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in (
            "config.json", "model.safetensors.index.json",
        ):  # fmt: skip
            shutil.copy(other, dst / other.name)
    return quantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("N", "K"))
    parser.add_argument("--per-tensor", action="store_true", help="one scale per tensor")
    args = parser.parse_args()
    scheme = Fp8Scheme(None, None) if args.per_tensor else Fp8Scheme(*args.block)
    count = quantize_folder(args.src, args.dst, scheme)
    print(f"fp8_checkpoint: {count} projections quantized into {args.dst}")


if __name__ == "__main__":
    main()
