"""Filling a meta-built CausalLM (or DeepseekForCausalLM): from a Hugging Face safetensors
folder, or at random.

Both materialize the model once, directly in the requested dtype and device, then fill it
tensor by tensor, so peak memory is the model plus one checkpoint tensor.

    config = ModelConfig.from_hf_folder(path)
    with torch.device("meta"):
        model = CausalLM(config)
    load_weights(model, path, torch.bfloat16, "cuda")
"""

import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.fp8 import FP8_DTYPE, quantize
from engine.model import CausalLM

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# How many names an error lists before it only counts the rest.
_MAX_NAMES_SHOWN = 10


def load_weights(
    model: CausalLM, folder: str | Path, dtype: torch.dtype, device: torch.device | str
) -> None:
    """Loads the folder's model.safetensors, or the shards its index lists, into model.

    Every checkpoint tensor must have a parameter to go to and every parameter a tensor, else
    ValueError naming them, raised before anything is allocated.
    """
    names, tensors = checkpoint_tensors(folder)
    load_tensors(model, names, tensors, dtype, device, source=f"checkpoint {folder}")


def checkpoint_tensors(
    folder: str | Path,
) -> tuple[list[str], Iterator[tuple[str, torch.Tensor]]]:
    """The names of the folder's checkpoint tensors, and the tensors, read one at a time."""
    files = _checkpoint_files(Path(folder))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file, file_names in files.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in file_names:
                    yield name, f.get_tensor(name)

    return [name for file_names in files.values() for name in file_names], tensors()


def load_mtp_weights(
    layer: nn.Module, folder: str | Path, dtype: torch.dtype, device: torch.device | str
) -> None:
    """Loads an MTP layer (engine.mtp.MtpLayer) from the checkpoint's tensors of its layer
    (`model.layers.<num_layers + index>.`), with the checks of load_weights. Its copy of the
    embedding is left out: the layer uses the target's."""
    files = _checkpoint_files(Path(folder))
    prefix = f"model.layers.{layer.layer_index}."
    wanted = {
        file: [n for n in names if n.startswith(prefix) and n != prefix + "embed_tokens.weight"]
        for file, names in files.items()
    }

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file, names in wanted.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names:
                    yield name.removeprefix(prefix), f.get_tensor(name)

    names = [name.removeprefix(prefix) for names in wanted.values() for name in names]
    load_tensors(layer, names, tensors(), dtype, device, source=f"checkpoint {folder} ({prefix}*)")


def load_state_dict(
    model: CausalLM,
    state_dict: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    """Loads Hugging Face-named tensors held in memory (e.g. a transformers model's
    state_dict()), with the same checks as load_weights."""
    load_tensors(
        model, list(state_dict), iter(state_dict.items()), dtype, device, source="state dict"
    )


def load_tensors(
    model: CausalLM,
    names: list[str],
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device | str,
    source: str,
    shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Loads the Hugging Face-named tensors `names` (`tensors` yields them, one at a time)
    into the meta-built model, with the checks of load_weights (`source` names them in its
    errors). `shard`: a tensor-parallel rank's cut of each tensor, applied first
    (engine/tensor_parallel.py)."""
    _check_dtype(dtype)
    targets = _targets(model)
    ignored = {name for name in names if _ignored(name, model.config)}
    unexpected = sorted(set(names) - ignored - targets.keys())
    missing = sorted(targets.keys() - set(names))
    if unexpected or missing:
        raise ValueError(
            f"{source} does not match {model.config.architecture}: "
            f"missing tensors: {_shown(missing)}; unexpected tensors: {_shown(unexpected)}"
        )
    _materialize(model, dtype, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors:
            if name in ignored:
                continue
            param_name, rows = targets[name]
            dest = params[param_name][rows]
            if shard is not None:
                tensor = shard(name, tensor)
            if param_name.endswith(SCALE):  # row-wise in memory (engine.fp8)
                tensor = model.config.fp8.expand_scale(tensor, dest.shape[0])
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(dest.shape)} (in {param_name})"
                )
            dest.copy_(tensor)  # converts dtype and moves to device in one copy
    model.init_buffers()


def init_random_weights(
    model: CausalLM, seed: int, dtype: torch.dtype, device: torch.device | str
) -> None:
    """Deterministic random weights for benchmarks: matrices N(0, 0.02) (fp8 ones quantized
    from those, with the config's block scales), norms 1, biases 0.

    std 0.02 (Hugging Face's initializer_range) keeps activations and logits finite at any
    depth; the same seed on the same device gives the same weights. They are loaded as the
    checkpoint random_checkpoint writes, so a tensor-parallel rank that loads its part of that
    checkpoint holds exactly this model's weights.
    """
    names, tensors = random_checkpoint(model, seed, dtype, device)
    load_tensors(model, names, tensors, dtype, device, "random weights")


def random_checkpoint(
    model: CausalLM, seed: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[list[str], Iterator[tuple[str, torch.Tensor]]]:
    """The Hugging Face-named tensors of deterministic random weights for the meta-built
    `model` (left on the meta device), drawn one parameter at a time: matrices N(0, 0.02), norms
    1, biases 0. An fp8 matrix is drawn in float32 and each of its checkpoint tensors (a fused
    projection's parts, a stack's experts) quantized as an FP8 checkpoint's are, yielded with
    its scales."""
    parts: dict[str, list[tuple[str, Index]]] = {}
    for hf_name, (param_name, rows) in _targets(model).items():
        parts.setdefault(param_name, []).append((hf_name, rows))
    names = [hf_name for param_parts in parts.values() for hf_name, _ in param_parts]
    _set_dtypes(model, dtype)
    fp8 = _fp8_matrices(model)
    scheme = getattr(model.config, "fp8", None)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device=torch.device(device)).manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith(SCALE):
                continue
            drawn = _draw(name, param, name in fp8, generator, device)
            if name not in fp8:
                for hf_name, rows in parts[name]:
                    yield hf_name, drawn[rows]
                continue
            for (hf_name, rows), (scale_name, _) in zip(
                parts[name], parts[name + SCALE], strict=True
            ):
                q, scale = quantize(drawn[rows], scheme)
                yield hf_name, q
                yield scale_name, scale

    return names, tensors()


def _fp8_matrices(model: nn.Module) -> set[str]:
    """The names of the model's fp8 matrices (each has its scales beside it: `<name>_scale`)."""
    return {
        f"{module_name}.{name}" if module_name else name
        for module_name, m in model.named_modules()
        if getattr(m, "fp8", None) is not None
        for name in m.fp8_parameters
    }


def _draw(
    name: str,
    param: torch.Tensor,
    fp8: bool,
    generator: torch.Generator,
    device: torch.device | str,
) -> torch.Tensor:
    """A parameter's random value (`param` may be on the meta device): norms 1, biases 0,
    matrices N(0, 0.02) drawn in the parameter's dtype (an fp8 one's in float32, to be
    quantized)."""
    drawn = torch.empty(param.shape, dtype=torch.float32 if fp8 else param.dtype, device=device)
    if name.endswith("norm.weight"):
        return drawn.fill_(1.0)
    if name.endswith(".bias"):
        return drawn.zero_()
    return drawn.normal_(0.0, 0.02, generator=generator)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported (supported: {SUPPORTED_DTYPES})")


def _materialize(model: CausalLM, dtype: torch.dtype, device: torch.device | str) -> None:
    """Allocates a meta-built model's parameters, uninitialized, in dtype on device."""
    materialized = [name for name, p in model.named_parameters() if not p.is_meta]
    if materialized:
        raise ValueError(f"model must be built on the meta device; {materialized[0]} is not")
    _set_dtypes(model, dtype)  # free on meta; makes to_empty allocate in the final dtypes
    model.to_empty(device=device)
    model.requires_grad_(False)  # serving never trains; no autograd bookkeeping on weights


def _set_dtypes(model: CausalLM, dtype: torch.dtype) -> None:
    """Every parameter in dtype, but those a module keeps in a dtype of its own."""
    model.to(dtype=dtype)
    for module in model.modules():
        for name, kept in _kept_dtypes(module):
            param = getattr(module, name)
            if param is not None:
                setattr(module, name, nn.Parameter(param.to(kept), requires_grad=False))


def _kept_dtypes(module: nn.Module) -> list[tuple[str, torch.dtype]]:
    """The parameters a module keeps in a dtype of their own whatever the model's: float32
    ones (a router's, fp8 scales) and an fp8 projection's weight (engine.fp8)."""
    kept = [(name, torch.float32) for name in getattr(module, "float32_parameters", ())]
    if getattr(module, "fp8", None) is not None:
        kept += [(name, FP8_DTYPE) for name in module.fp8_parameters]
    return kept


def _checkpoint_files(folder: Path) -> dict[Path, list[str]]:
    """Each safetensors file of the checkpoint and the tensor names it holds."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files: dict[Path, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(folder / file, []).append(name)
        return files
    single = folder / "model.safetensors"
    if single.exists():
        with safe_open(single, framework="pt", device="cpu") as f:
            return {single: list(f.keys())}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")


SCALE = "_scale"  # an fp8 matrix's scales: `<its name>_scale` (engine.model.Linear, moe.Experts)

# Where a checkpoint tensor goes within one of our parameters: all of it, a run of its rows, or
# (for stacked experts) one expert's slab or a run of that slab's rows.
Index = slice | tuple[int] | tuple[int, slice]


def _targets(model: CausalLM) -> dict[str, tuple[str, Index]]:
    """Checkpoint tensor name -> (our parameter name, the part of it the tensor fills)."""
    targets: dict[str, tuple[str, Index]] = {}
    for name, param in model.named_parameters():
        parent, _, leaf = name.rpartition(".")
        prefix, _, module = parent.rpartition(".")
        if module == "experts":  # stacked [experts, ...]: one checkpoint tensor per expert
            stack = leaf.removesuffix(SCALE)  # gate_up_proj, or its scales gate_up_proj_scale
            suffix = model.config.fp8.scale_name if stack != leaf else "weight"
            for expert in range(param.shape[0]):
                for part, rows in _fused_parts(model.config, stack, param.shape[1]):
                    targets[f"{parent}.{expert}.{part}.{suffix}"] = (name, (expert, rows))
            continue
        if leaf == f"weight{SCALE}":  # the checkpoint's name of an fp8 projection's scales
            leaf = model.config.fp8.scale_name
        parts = _fused_parts(model.config, module, param.shape[0])
        for part, rows in parts:
            targets[f"{prefix}.{part}.{leaf}" if len(parts) > 1 else f"{parent}.{leaf}"] = (
                name,
                rows,
            )
    return targets


def _fused_parts(config: ModelConfig, module: str, rows: int) -> list[tuple[str, slice]]:
    """Our projection (of `rows` rows) -> the Hugging Face projections stacked in it, with
    their rows; itself alone if it fuses nothing."""
    if module == "gate_up_proj":
        sizes = [("gate_proj", rows // 2), ("up_proj", rows // 2)]
    elif module == "fused_qkv_a_proj":  # MLA: q's projection (or its bottleneck), then the latent's
        assert config.mla is not None
        q_part = "q_proj" if config.mla.q_lora_rank is None else "q_a_proj"
        latent = config.mla.latent_dim
        sizes = [(q_part, rows - latent), ("kv_a_proj_with_mqa", latent)]
    elif module == "qkv_proj":
        kv_rows = config.num_kv_heads * config.head_dim
        sizes = [("q_proj", rows - 2 * kv_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)]
    else:
        return [(module, slice(None))]
    parts, offset = [], 0
    for part, size in sizes:
        parts.append((part, slice(offset, offset + size)))
        offset += size
    return parts


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _ignored(name: str, config: ModelConfig) -> bool:
    # Old checkpoints saved the RoPE buffer; some tied ones still carry an lm_head copy, which
    # tying means is never read (Hugging Face ignores it too). DeepSeek-V3 checkpoints carry
    # their multi-token-prediction module as layers past num_layers, which generation does
    # not use.
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if config.tie_word_embeddings and name == "lm_head.weight":
        return True
    layer = _LAYER.match(name)
    return config.mla is not None and layer is not None and int(layer[1]) >= config.num_layers


def _shown(names: list[str]) -> str:
    if not names:
        return "none"
    more = len(names) - _MAX_NAMES_SHOWN
    return ", ".join(names[:_MAX_NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under Hugging Face names, as views (no copy): the inverse of
    load_state_dict, e.g. to give a transformers model exactly the same weights."""
    params = dict(model.named_parameters())
    state = {}
    for name, (param, rows) in _targets(model).items():
        tensor = params[param][rows]
        if param.endswith(SCALE):  # back to the checkpoint's blocks: each block's first row
            block_n = model.config.fp8.block_n
            tensor = tensor[0, 0] if block_n is None else tensor[::block_n]
        state[name] = tensor
    return state
