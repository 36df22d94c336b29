"""tandem's KV connector for stock vLLM: vLLM prefills, tandem's decode server decodes.

    python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config \
      '{"kv_connector": "TandemConnector", "kv_connector_module_path": "prefill.vllm_connector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"transport": "tcp"}}'

A request whose `kv_transfer_params` carry a tandem ticket (the router's POST /v1/completions
with max_tokens=1) has its prompt's KV written into the ticket's decode blocks, each layer as
soon as vLLM computed it; the reply's `kv_transfer_params` carry the first token. Every other
request is left alone. The connector is a thin facade: vLLM builds it twice, once per role,
and each role forwards to its side (prefill/vllm_scheduler_side.py, prefill/vllm_worker_side.py).
An MLA model's (DeepSeek-V2/V3) KV goes as the decode server's "mla-latent" format: one latent
plane a layer, sent by one tensor-parallel rank (vllm_worker_side.LATENT_SENDER_RANK).

Hooks in vLLM's call order, per engine step:
  scheduler: update_state_after_alloc -> build_connector_meta -> (forward) -> request_finished
  worker:    bind_connector_metadata -> save_kv_layer, per layer -> wait_for_save
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

import transport
from prefill.ticket import KV_FORMAT_HND, KV_FORMAT_MLA_LATENT, PROPOSER_KV_METHODS
from prefill.vllm_config import TandemConnectorConfig
from prefill.vllm_layouts import (
    CPU_LATENT_BACKENDS,
    LATENT_CACHE_DTYPES,
    cache_views,
    check_latent_write,
    latent_views,
    refuse_unpaired_rope,
)
from prefill.vllm_metadata import TandemMetadata
from prefill.vllm_scheduler_side import SchedulerSide
from prefill.vllm_worker_side import ProposerLayers, WorkerFacts, WorkerSide, num_senders

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class TandemConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = TandemConnectorConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                f"TandemConnector: the model has {len(kv_cache_config.kv_cache_groups)} KV "
                "cache groups; only models with one (every layer full attention) are supported"
            )
        model = vllm_config.model_config
        kv_format = KV_FORMAT_MLA_LATENT if model.use_mla else KV_FORMAT_HND
        hf_config = model.hf_text_config
        if model.use_mla:  # in both roles: vLLM stops at start-up
            refuse_unpaired_rope(model.model, getattr(hf_config, "rope_interleave", True))
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(num_senders=num_senders(kv_format, tp_size))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            facts = WorkerFacts(
                model_name=model.served_model_name or model.model,
                num_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
                head_dim=model.get_head_size(),  # MLA: kv_lora_rank + qk_rope_head_dim
                block_size=vllm_config.cache_config.block_size,
                tp_rank=get_tensor_model_parallel_rank(),
                tp_size=tp_size,
                kv_format=kv_format,
                kv_lora_rank=hf_config.kv_lora_rank if model.use_mla else 0,
            )
            agent = transport.create(self.config.transport, host=self.config.host)
            self._worker = WorkerSide(self.config, facts, agent)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between layers: a captured graph would skip it

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        num_layers = self._vllm_config.model_config.hf_text_config.num_hidden_layers
        layers, extra = [], []
        for name, cache in ordered:
            own = not name.startswith("draft_model.") and extract_layer_index(name) < num_layers
            (layers if own else extra).append((name, cache))
        context = self._vllm_config.compilation_config.static_forward_context
        facts = self._worker.facts
        attention = context[layers[0][0]]
        backend = attention.attn_backend.get_name()
        proposer = self._proposer_layers(extra, context)
        if facts.latent:
            kv_cache_dtype = attention.kv_cache_dtype
            if facts.sends:
                _check_cpu_latent(attention, backend, layers[0][1], facts)
            scales = (attention._k_scale_float, attention._k_scale_float)  # one latent plane
            self._worker.register(
                layers, backend, kv_cache_dtype=kv_cache_dtype, kv_scales=scales, proposer=proposer
            )
            return
        dtype = self._vllm_config.model_config.dtype
        cpu_layout = _cpu_layout(attention, layers[0][1], facts.heads, facts.head_dim, dtype)
        scales = (attention._k_scale_float, attention._v_scale_float)
        self._worker.register(
            layers, backend, cpu_layout, attention.kv_cache_dtype, scales, proposer
        )

    def _proposer_layers(self, extra: list, context: dict) -> ProposerLayers | None:
        """The speculative proposer's layers, when tandem's decode server has a proposer of the
        same method that reads them (draft_model, mtp, eagle3: a draft model's or EAGLE-3
        head's layers are dense, the MTP layers in the model's format) and vLLM runs on one
        rank; None: they are not sent (a decode server whose proposer needs them refuses this
        prefill at Hello, naming what is missing)."""
        spec = self._vllm_config.speculative_config
        method = None if spec is None else spec.method
        if not extra or method not in PROPOSER_KV_METHODS or self._worker.facts.tp_size > 1:
            if extra:
                logger.warning(
                    "TandemConnector: the %d layer(s) of speculative method %s are not sent "
                    "(sent: draft_model, mtp or eagle3, at tensor_parallel_size 1)",
                    len(extra),
                    method,
                )
            return None
        names = [name for name, _ in extra]
        attention = context[names[0]]
        if attention.kv_cache_dtype not in LATENT_CACHE_DTYPES:
            logger.warning(
                "TandemConnector: the %s layers' %s KV cache is not sent (an fp8 proposer "
                "cache is not supported)", method, attention.kv_cache_dtype,
            )  # fmt: skip
            return None
        backend = attention.attn_backend.get_name()
        facts = self._worker.facts
        if method == "mtp":  # the model's own layers: its cache format
            if facts.latent:
                rank, rope = facts.kv_lora_rank, facts.head_dim - facts.kv_lora_rank
                views = [latent_views(backend, t, rank, rope, attention.kv_cache_dtype)
                         for _, t in extra]  # fmt: skip
            else:
                model = self._vllm_config.model_config
                views = _dense_views(extra, attention, facts.num_kv_heads, facts.head_dim, model)
            return ProposerLayers(method, names, views, facts.kv_format, facts.num_kv_heads,
                                  facts.head_dim)  # fmt: skip
        draft = spec.draft_model_config
        if draft.use_mla:
            raise ValueError("TandemConnector: an MLA draft model's KV is not sent")
        heads, head_dim = draft.get_total_num_kv_heads(), draft.get_head_size()
        views = _dense_views(extra, attention, heads, head_dim, draft)
        return ProposerLayers(method, names, views, KV_FORMAT_HND, heads, head_dim)

    def bind_connector_metadata(self, connector_metadata: TandemMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass  # a producer loads nothing

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.step_done()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side ------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.block_ids_of = lambda req_id: kv_cache_manager.get_block_ids(req_id)[0]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # nothing to load: prefill computes its prompts itself

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.track(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TandemMetadata:
        return self._scheduler.build_meta(scheduler_output.num_scheduled_tokens)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_work()


def _dense_views(layers: list, attention, heads: int, head_dim: int, model) -> list:
    """K and V views of a proposer's layers (all of its heads: it runs on one rank)."""
    backend = attention.attn_backend.get_name()
    layout = _cpu_layout(attention, layers[0][1], range(heads), head_dim, model.dtype)
    return [cache_views(backend, t, heads, head_dim, layout) for _, t in layers]


def _cpu_layout(attention, like: torch.Tensor, heads: range, head_dim: int, dtype) -> str:
    """Which of CPU_ATTN's layouts a layer's cache has (vllm_layouts.detect_cpu_layout), found
    with its own cache update (`dtype`: its model's); "vllm-cpu" for other backends (unused by
    them)."""
    if attention.attn_backend.get_name() != "CPU_ATTN":
        return "vllm-cpu"
    from prefill.vllm_layouts import detect_cpu_layout

    def write(key, value, cache, slots) -> None:
        attention.impl.do_kv_cache_update(attention, key, value, cache, slots)

    return detect_cpu_layout(like, len(heads), head_dim, write, dtype)


def _check_cpu_latent(attention, backend: str, like: torch.Tensor, facts: WorkerFacts) -> None:
    """On CPU, that the MLA backend's own cache update stores rows the worker side reads
    (vllm_layouts.check_latent_write); GPU layouts are read as vLLM documents them."""
    if backend not in CPU_LATENT_BACKENDS:
        return
    rank = facts.kv_lora_rank

    def write(latent, cache, slots) -> None:
        # NOTE: as MLAAttention.bind_kv_cache does, the backend gets [blocks, block_size, row].
        rows = cache[:, 0] if cache.dim() == 4 else cache
        kv_c, k_pe = latent[:, :rank].contiguous(), latent[:, None, rank:].contiguous()
        attention.impl.do_kv_cache_update(
            kv_c, k_pe, rows, slots, attention.kv_cache_dtype, attention._k_scale
        )

    check_latent_write(backend, like, rank, facts.head_dim - rank, write)
