"""tandem.v1.DecodeService: the gRPC face of admission (decode/admission.py) and the engine
loop (decode/engine_loop.py). Every refusal is a gRPC status whose message names the values.
Once the engine has failed, Reserve, Generate and Stats answer UNAVAILABLE with its failure (the
router then marks the instance down, and its Stats probe keeps it down until a restart)."""

from __future__ import annotations

import time

import grpc

from decode.admission import Admission, AdmissionError
from decode.engine_loop import EngineFailed, EngineLoop, Finished
from decode.layout import mismatch
from decode.metrics import DecodeMetrics
from engine.kv_cache import KVCache
from engine.sampling import SamplingParams
from engine.sequence import FinishReason, StopConditions
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2

_FINISH = {
    FinishReason.STOP: decode_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: decode_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: decode_pb2.FINISH_REASON_ABORT,
}
_SAMPLING_FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
]


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        admission: Admission,
        loop: EngineLoop,
        kv_cache: KVCache,
        layout: layout_pb2.LayoutDescriptor,
        endpoint: layout_pb2.TransportEndpoint,
        metrics: DecodeMetrics,
    ) -> None:
        self.admission = admission
        self.loop = loop
        self.kv_cache = kv_cache
        self.layout = layout
        self.endpoint = endpoint
        self.metrics = metrics
        self._tokens_generated = 0

    def Hello(self, request, context):
        problem = mismatch(self.layout, request.sender_layout)
        if problem:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"sender {request.sender_id or '?'} cannot write here: {problem}",
            )
        return decode_pb2.HelloResponse(decode_layout=self.layout, endpoints=[self.endpoint])

    def Reserve(self, request, context):
        self._check_engine(context)
        res = self._call(
            context,
            self.admission.reserve,
            request.request_id,
            list(request.prompt_token_ids),
            request.num_senders or 1,
            request.max_tokens,
            request.transfer_timeout_ms / 1000,
        )
        deadline_unix_ms = int((time.time() + res.deadline - self.admission.clock()) * 1000)
        regions = [
            layout_pb2.LayerRegions(
                k=layout_pb2.KvRegion(addr=r.k_ptr, nbytes=r.nbytes, **self._device()),
                v=layout_pb2.KvRegion(addr=r.v_ptr, nbytes=r.nbytes, **self._device()),
            )
            for r in self.kv_cache.layer_regions()
        ]
        shard = decode_pb2.KvShard(
            rank=0, heads=self.layout.head_ranges[0], endpoint=self.endpoint, layers=regions
        )
        return decode_pb2.ReserveResponse(
            ticket=decode_pb2.Ticket(
                request_id=res.request_id,
                generation=res.generation,
                num_tokens=len(res.prompt_ids),
                block_ids=res.block_ids,
                block_stride_bytes=self.kv_cache.block_stride_bytes,
                head_stride_bytes=self.kv_cache.head_stride_bytes,
                shards=[shard],
                layout=self.layout,
                num_senders=res.num_senders,
                deadline_unix_ms=deadline_unix_ms,
            )
        )

    def Commit(self, request, context):
        committed, expected = self._call(
            context,
            self.admission.commit,
            request.request_id,
            request.generation,
            request.sender_rank,
            request.bytes_written,
            request.layers_written,
            request.error,
        )
        self.metrics.transfer_bytes.inc(request.bytes_written)
        return decode_pb2.CommitResponse(committed_senders=committed, expected_senders=expected)

    def Generate(self, request, context):
        started = time.monotonic()
        res = self._call(context, self.admission.wait_ready, request.request_id, request.generation)
        self._check_engine(context)
        try:
            sampling = SamplingParams(
                **{
                    f: getattr(request.sampling, f)
                    for f in _SAMPLING_FIELDS
                    if request.sampling.HasField(f)
                }
            )
            stop = StopConditions(
                max_tokens=request.max_tokens or res.max_tokens or 1,
                min_tokens=request.min_tokens,
                stop_token_ids=tuple(request.stop_token_ids),
                ignore_eos=request.ignore_eos,
            )
            seq = self.loop.engine.new_sequence(res.request_id, res.prompt_ids, sampling, stop)
        except ValueError as e:
            self.admission.abort(res.request_id, res.generation, f"bad request: {e}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        blocks = self._call(context, self.admission.take, res)
        stream = self.loop.submit(seq, blocks, request.first_token_id)
        context.add_callback(lambda: self.loop.abort(seq.seq_id))  # client gone: stop decoding
        first = True
        for item in stream:
            if isinstance(item, EngineFailed):
                context.abort(grpc.StatusCode.UNAVAILABLE, item.message)
            if isinstance(item, Finished):
                yield decode_pb2.GenerateResponse(
                    finish_reason=_FINISH[item.reason],
                    usage=decode_pb2.Usage(
                        prompt_tokens=item.prompt_tokens,
                        completion_tokens=item.completion_tokens,
                    ),
                )
                return
            if first:
                self.metrics.handover_seconds.observe(time.monotonic() - started)
                first = False
            self.metrics.tokens_generated.inc(len(item))
            self._tokens_generated += len(item)
            yield decode_pb2.GenerateResponse(token_ids=item)

    def Abort(self, request, context):
        aborted = self.admission.abort(
            request.request_id,
            request.generation,
            request.reason or "aborted by client",
            writers_possible=not request.ticket_undelivered,
        )
        if not aborted and request.request_id in self.loop.engine.sequences:
            self.loop.abort(request.request_id)
            aborted = True
        return decode_pb2.AbortResponse(aborted=aborted)

    def Stats(self, request, context):
        self._check_engine(context)
        self.admission.expire()
        pool = self.admission.pool
        engine = self.loop.engine
        outstanding = sum(
            s.stop.max_tokens - s.num_output_tokens for s in list(engine.sequences.values())
        )
        return decode_pb2.StatsResponse(
            kv_blocks_total=pool.num_total,
            kv_blocks_free=pool.num_free,
            kv_blocks_quarantined=self.admission.num_quarantined_blocks,
            running=self.loop.num_running,
            waiting=self.loop.num_waiting,
            reserved=self.admission.num_reserved,
            outstanding_tokens=outstanding,
            tokens_generated=self._tokens_generated,
            layout=self.layout,
        )

    def _device(self) -> dict:
        device = self.kv_cache.storage.device
        return {"device_id": device.index or 0, "is_gpu": device.type == "cuda"}

    def _check_engine(self, context) -> None:
        if self.loop.failure is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.loop.failure)

    @staticmethod
    def _call(context, fn, *args):
        try:
            return fn(*args)
        except AdmissionError as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
