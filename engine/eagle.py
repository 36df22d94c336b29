"""EAGLE-3 draft heads (vLLM's `{"method": "eagle3", "model": HEAD}`): one decoder layer fed the
target's own hidden states, proposing drafts from a reduced vocabulary.

The target (a Llama-family model) exposes the residual stream entering three of its layers
(`aux_layers`: by default 2, L / 2 and L - 3 of its L layers, as vLLM; or the head config's
`eagle_config.eagle_aux_hidden_state_layer_ids`), concatenated per token; `fc` projects them to
the head's width. At position j the head takes that projection of the target's state at j, a,
and the embedding e of token j + 1 (the target's embedding, or the head's own if its checkpoint
has one):

    x = a                                   (the residual stream)
    h = [input_layernorm(e), hidden_norm(x)]            (2 x hidden wide)
    x = x + o_proj(attention(qkv_proj(h)))              (its own paged KV cache)
    x = x + mlp(post_attention_layernorm(x))
    g = x;  logits = lm_head(norm(x))                   (over draft_vocab_size tokens)

and a draft token d of the reduced vocabulary is the target's token d + d2t[d]. Deeper drafts
feed g back in place of a (engine.hidden_proposer chains them), as vLLM's EAGLE-3 does.

Checkpoints: a folder whose config.json names `LlamaForCausalLMEagle3` (or
`Eagle3LlamaForCausalLM`), one layer under `midlayer.` (or `layers.0.`), `fc`, `norm`, `lm_head`,
`d2t` (and `t2d`, unused), in model.safetensors or pytorch_model.bin. The variants some trainers
write (norm_before_residual, norm_before_fc, fc_norm, norm_output, several layers) are refused
by name. Random heads for benchmarks: `random:eagle3-<preset>` (EAGLE3_PRESETS).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.model import (
    MLP,
    Attention,
    CausalLM,
    Linear,
    ModelOps,
    RMSNorm,
    RotaryEmbedding,
    rope_inv_freq,
    split_heads,
)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig
    """The head's decoder layer as a one-layer Llama (its vocab_size is the target's)."""
    draft_vocab_size: int
    aux_layers: tuple[int, ...] | None = None
    """The target layers whose input stream the head reads; None: (2, L / 2, L - 3)."""

    def target_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """The aux layers for `target`, checked against it (ValueError naming the fix)."""
        if target.mla is not None:
            raise ValueError(
                f"speculative_config.method eagle3: the target {target.architecture} is of the "
                "MLA family; EAGLE-3 heads run on Llama-family targets (use method mtp)"
            )
        if self.layer.hidden_size != target.hidden_size:
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's hidden_size "
                f"{self.layer.hidden_size} is not the target's {target.hidden_size}"
            )
        if self.layer.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's vocab_size "
                f"{self.layer.vocab_size} is not the target's {target.vocab_size}"
            )
        n = target.num_layers
        layers = self.aux_layers or (2, n // 2, n - 3)
        if len(set(layers)) != len(layers) or not all(0 <= i < n for i in layers):
            raise ValueError(
                f"speculative_config.model: EAGLE-3 reads target layers {list(layers)}, which "
                f"are not distinct layers of the target's {n} (set "
                "eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json)"
            )
        return tuple(layers)

    @classmethod
    def from_hf_dict(cls, d: dict) -> Eagle3Config:
        architectures = d.get("architectures") or []
        if architectures not in ([a] for a in ARCHITECTURES):
            raise ValueError(
                f"architectures: {architectures!r} is not an EAGLE-3 head "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        eagle = d.get("eagle_config") or {}
        for name in _VARIANTS:
            if d.get(name) or eagle.get(name):
                raise ValueError(f"EAGLE-3 head: {name}=true is not supported")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"EAGLE-3 head: num_hidden_layers={d['num_hidden_layers']} is not supported "
                "(supported: 1)"
            )
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError("EAGLE-3 head: use_aux_hidden_state=false is not supported")
        if d.get("target_hidden_size") not in (None, d.get("hidden_size")):
            raise ValueError(
                f"EAGLE-3 head: target_hidden_size={d['target_hidden_size']} other than its "
                "hidden_size is not supported"
            )
        layer = ModelConfig.from_hf_dict({**d, "architectures": ["LlamaForCausalLM"]})
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            layer=layer,
            draft_vocab_size=int(d.get("draft_vocab_size") or layer.vocab_size),
            aux_layers=None if ids is None else tuple(int(i) for i in ids),
        )

    @classmethod
    def load(cls, model: str) -> Eagle3Config:
        """A folder's config.json, or random:eagle3-<preset>."""
        if model.startswith("random:"):
            name = model.removeprefix("random:")
            if name not in EAGLE3_PRESETS:
                raise ValueError(
                    f"speculative_config.model: {model} is not an EAGLE-3 preset "
                    f"(presets: {', '.join(sorted(EAGLE3_PRESETS))})"
                )
            return EAGLE3_PRESETS[name]()
        path = Path(model) / "config.json"
        if not path.is_file():
            raise ValueError(f"speculative_config.model: {model} has no config.json")
        return cls.from_hf_dict(json.loads(path.read_text()))


def _preset(target: str, draft_vocab: int) -> Eagle3Config:
    layer = dataclasses.replace(ModelConfig.preset(target), num_layers=1)
    return Eagle3Config(layer, draft_vocab)


EAGLE3_PRESETS = {
    # The shape of Llama-3.1-8B-Instruct's EAGLE-3 heads: 32,000 draft tokens of 128,256.
    "eagle3-llama3-8b": lambda: _preset("llama3-8b", 32000),
    # For tests: SmolLM2-135M's shape, drafting from 12,000 of its 49,152 tokens; tiny's
    # (for tiny-8l), from 200 of its 256.
    "eagle3-smollm2": lambda: _preset("smollm2-135m", 12000),
    "eagle3-tiny": lambda: _preset("tiny", 200),
}


class Eagle3Layer(nn.Module):
    """The head's decoder layer (`midlayer.`): a Llama layer whose q/k/v read the normalized
    embedding and hidden state side by side."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: ModelOps) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.hidden_norm = RMSNorm(hidden, eps, ops)
        self.self_attn = Attention(config, backend, ops)
        attn = self.self_attn
        kv_size = config.num_kv_heads * config.head_dim
        attn.qkv_proj = Linear(2 * hidden, attn.q_size + 2 * kv_size, False, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.mlp = MLP(config, ops)


class Eagle3Head(nn.Module):
    def __init__(
        self,
        config: Eagle3Config,
        num_aux: int,
        backend: AttentionBackend,
        ops: ModelOps,
        own_embedding: bool = False,
    ) -> None:
        super().__init__()
        layer = config.layer
        self.config = layer  # engine.weights reads the layer's shape (fused q/k/v rows)
        self.ops = ops
        self.backend = backend
        self.midlayer = Eagle3Layer(layer, backend, ops)
        self.fc = Linear(num_aux * layer.hidden_size, layer.hidden_size, False, ops)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps, ops)
        self.lm_head = Linear(layer.hidden_size, config.draft_vocab_size, False, ops)
        self.embed_tokens = (
            nn.Embedding(layer.vocab_size, layer.hidden_size) if own_embedding else None
        )
        self.rotary_emb = RotaryEmbedding(layer)
        self.register_buffer(
            "draft_to_target",
            torch.empty(config.draft_vocab_size, dtype=torch.long),
            persistent=False,
        )
        """The target's token id of each draft token: d + d2t[d]."""

    def init_buffers(self) -> None:
        """RoPE frequencies (engine.weights calls this after filling; the draft_to_target map
        is set by `load_head`)."""
        rotary = self.rotary_emb
        rotary.inv_freq = rope_inv_freq(self.config).to(rotary.inv_freq.device)
        rotary.table = None

    def prepare(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [T, num_aux * hidden] -> the head's input a [T, hidden]."""
        return self.fc(aux)

    @torch.inference_mode()
    def predict(
        self,
        target: CausalLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, hidden], logits [T or len(logit_rows), target vocab] float32: -inf outside
        the draft vocabulary) for tokens `input_ids` at `positions`, each after `previous` (the
        prepared target state, or g of the draft before)."""
        layer, ops = self.midlayer, self.ops
        embed = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        embedded = embed(input_ids)
        h = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(previous)], dim=-1)
        attn = layer.self_attn
        q, k, v = split_heads(
            ops.linear(h, attn.qkv_proj.matrix, None), attn.num_heads, attn.num_kv_heads
        )
        cos, sin = self.rotary_emb(positions, embedded.dtype)
        q, k = ops.rope(q, k, cos, sin)
        o = self.backend.attention(q, k, v, *kv_cache, meta, attn.scale)
        inp = attn.o_proj.add_forward(o.reshape(len(positions), -1), previous,
                                      layer.post_attention_layernorm)  # fmt: skip
        normed, g = layer.mlp(inp, self.norm).compute(ops)
        if logit_rows is not None:
            normed = normed[logit_rows]
        draft = ops.linear(normed, self.lm_head.matrix, None).float()
        if draft.shape[1] == self.config.vocab_size:
            return g, draft
        logits = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        return g, logits.index_copy_(1, self.draft_to_target, draft)


def load_head(
    config: Eagle3Config,
    model: str,
    num_aux: int,
    backend: AttentionBackend,
    ops: ModelOps,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> Eagle3Head:
    """The head of `model` (a folder, or random:<preset>: random weights from `seed` and a
    draft vocabulary of that many target tokens drawn from it) on `device`."""
    from engine.weights import init_random_weights, load_tensors

    if model.startswith("random:"):
        with torch.device("meta"):
            head = Eagle3Head(config, num_aux, backend, ops)
        init_random_weights(head, seed, dtype, device)
        vocab, draft = config.layer.vocab_size, config.draft_vocab_size
        generator = torch.Generator().manual_seed(seed)
        kept = torch.randperm(vocab, generator=generator)[:draft].sort().values
        head.draft_to_target.copy_(kept)
        return head.eval()
    state = _checkpoint(Path(model))
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)
    state = {name.replace("layers.0.", "midlayer.", 1): t for name, t in state.items()}
    with torch.device("meta"):
        head = Eagle3Head(config, num_aux, backend, ops, "embed_tokens.weight" in state)
    load_tensors(head, list(state), iter(state.items()), dtype, device, f"EAGLE-3 head {model}")
    offsets = torch.zeros(config.draft_vocab_size, dtype=torch.long) if d2t is None else d2t
    if offsets.shape != (config.draft_vocab_size,):
        raise ValueError(
            f"EAGLE-3 head {model}: d2t has shape {tuple(offsets.shape)}, expected "
            f"({config.draft_vocab_size},)"
        )
    head.draft_to_target.copy_(torch.arange(config.draft_vocab_size) + offsets.long())
    if head.draft_to_target.min() < 0 or head.draft_to_target.max() >= config.layer.vocab_size:
        raise ValueError(f"EAGLE-3 head {model}: d2t maps draft tokens outside the vocabulary")
    return head.eval()


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head's checkpoint (heads are small: read whole)."""
    from engine.weights import checkpoint_tensors

    if (folder / "pytorch_model.bin").is_file() and not (folder / "model.safetensors").exists():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    _, tensors = checkpoint_tensors(folder)
    return dict(tensors)
