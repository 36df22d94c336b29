"""The decode server: tandem.v1.DecodeService over gRPC on top of the engine.

    python -m decode.server --model DIR --host 127.0.0.1 --grpc-port 50051 --metrics-port 9100 \
        --transport tcp --device cpu --dtype bfloat16

Its KV cache is registered with the transport at start-up; tickets point senders straight into
its blocks. A component that cannot start (bad model folder, port taken, transport unavailable)
exits non-zero with one line saying what and how to fix it.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from prometheus_client import start_http_server

from decode.admission import Admission
from decode.commit_notices import CommitNotices
from decode.engine_loop import EngineLoop
from decode.kv_shards import DecodeRankAgent, kv_shard, ticket_destination
from decode.metrics import DecodeMetrics
from decode.service import DecodeServicer
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import read_model_config
from engine.tensor_parallel import cache_heads, kv_replicas
from prefill.engine_layout import engine_layout
from prefill.ticket import DECODE_LAYOUT, SpeculativeKv
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2
from rpc import health, keepalive, registration
from tools import preflight
from transport.config import KvTransportConfig


@dataclass(frozen=True)
class DecodeServerConfig:
    engine: EngineConfig
    kv: KvTransportConfig = field(default_factory=KvTransportConfig)
    """Transport, the interface for gRPC, metrics and the transport's listener, and the default
    time senders have to write and commit a ticket's KV."""
    grpc_port: int = 0
    """0: the OS picks one (printed at start-up)."""
    metrics_port: int | None = None
    """Prometheus /metrics; None: not served."""
    model_name: str = ""
    """Served model name (informational); default: the model argument."""
    drain_grace_s: float = 30.0
    """On SIGTERM: seconds the requests already admitted get to finish before the server
    stops (it refuses new ones at once)."""

    def __post_init__(self) -> None:
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port: {self.grpc_port} is not a port number")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s: {self.drain_grace_s} must be >= 0")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        EngineConfig.add_cli_args(parser)
        KvTransportConfig.add_cli_args(parser)
        parser.add_argument("--grpc-port", type=int, default=0)
        parser.add_argument("--metrics-port", type=int, default=None)
        parser.add_argument("--served-model-name", default="")
        parser.add_argument("--drain-grace-s", type=float, default=30.0,
                            help="on SIGTERM, seconds admitted requests get to finish")  # fmt: skip

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> DecodeServerConfig:
        return cls(
            engine=EngineConfig.from_cli_args(args),
            kv=KvTransportConfig.from_cli_args(args),
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            model_name=args.served_model_name,
            drain_grace_s=args.drain_grace_s,
        )


class DecodeServer:
    """Everything one decode instance runs; `start()` returns once it serves."""

    def __init__(self, config: DecodeServerConfig) -> None:
        self.config = config
        tp_size = config.engine.tensor_parallel_size
        # The whole model's shape: the engine's model_config is rank 0's share of the heads.
        model = read_model_config(config.engine)
        self.engine = LLMEngine.build(
            config.engine, rank_agent=functools.partial(DecodeRankAgent, config.kv, model, tp_size)
        )
        cache, proposer_cache = self.engine.kv_cache, self.engine.proposer_cache
        caches = [c.region() for c in (cache, proposer_cache) if c is not None]
        self.transport = config.kv.create_registered(caches, str(cache.storage.device))
        layout = engine_layout(
            config.engine,
            name=config.model_name or config.engine.model,
            layout=DECODE_LAYOUT,
            transport=config.kv.backend,
        )
        spec = SpeculativeKv.parse(layout.speculative_kv)
        self.admission = Admission(
            self.engine.pool,
            config.engine.block_size,
            model.num_layers + (spec.num_layers if spec else 0),
            # A head replicated over ranks (an MLA latent) is written to each.
            model.kv_bytes_per_token(config.engine.kv_dtype) * kv_replicas(model, tp_size)
            + (spec.bytes_per_token if spec else 0),
            self.engine.max_model_len,
            default_timeout_s=config.kv.transfer_timeout_s,
            prefix_cache=self.engine.scheduler.prefix_cache,
        )
        self.loop = EngineLoop(self.engine)
        endpoint = layout_pb2.TransportEndpoint(
            transport=config.kv.backend, metadata=self.transport.endpoint()
        )
        heads = cache_heads(model, tp_size, 0)
        shards = [kv_shard(0, heads, endpoint, cache, proposer_cache)]
        if self.engine.tp_workers is not None:
            shards += [decode_pb2.KvShard.FromString(i) for i in self.engine.tp_workers.infos]
        self.instance_id = uuid.uuid4().hex
        destination = ticket_destination(layout, shards, cache, proposer_cache, self.instance_id)
        destination.commit_by_notification = True  # self._commit_notices reads them
        pool = self.engine.pool
        self.metrics = DecodeMetrics(
            {
                "kv_blocks_total": lambda: pool.num_total,
                "kv_blocks_free": lambda: pool.num_free,
                "kv_blocks_quarantined": lambda: self.admission.num_quarantined_blocks,
                "running": lambda: self.loop.snapshot.running,
                "waiting": lambda: self.loop.snapshot.waiting,
                "reserved": lambda: self.admission.num_reserved,
                "engine_up": lambda: float(self.loop.failure is None),
            },
            self.engine.spec_stats if config.engine.speculative_config else None,
            self.engine.scheduler.prefix_cache,
        )
        self.servicer = DecodeServicer(self.admission, self.loop, destination, self.metrics)
        # NOTE: without so_reuseport=0 a second server would silently share a taken port.
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=64),
            options=[("grpc.so_reuseport", 0), *keepalive.SERVER_OPTIONS],
        )
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self.servicer, self._grpc)
        # Kubernetes' gRPC probes: serving while the engine steps and no drain has begun.
        self._grpc.add_generic_rpc_handlers(
            (health.handler(self._serving, ("tandem.v1.DecodeService",)),)
        )
        address = f"{config.kv.host}:{config.grpc_port}"
        try:
            self.port = self._grpc.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            self.loop.stop()
            self.engine.close()
            self.transport.close()
            raise OSError(f"cannot listen on {address}: port taken? pick another --grpc-port")
        self._stop = threading.Event()
        self._expiry = threading.Thread(target=self._expire_loop, daemon=True)
        self._commit_notices: CommitNotices | None = None
        self.metrics_port: int | None = None

    def start(self) -> None:
        self._grpc.start()
        self._expiry.start()
        self._commit_notices = CommitNotices(self.transport, self.admission, self.servicer.commit)
        if self.config.metrics_port is not None:
            server, _ = start_http_server(
                self.config.metrics_port, self.config.kv.host, registry=self.metrics.registry
            )
            self.metrics_port = server.server_port

    def stop(self, grace: float | None = None) -> None:
        """Stops at once (grace None) or lets the RPCs under way finish for up to `grace` s."""
        self._stop.set()
        self._grpc.stop(grace=grace).wait()
        if self._commit_notices is not None:
            self._commit_notices.close()
        self.loop.stop()
        self.engine.close()
        self.transport.close()

    def drain(self) -> int:
        """Refuses new requests (UNAVAILABLE, and Stats says `draining`), waits up to
        drain_grace_s for the admitted ones to end, then stops; returns how many were still
        live (their streams end with an error)."""
        self.servicer.draining = True
        deadline = time.monotonic() + self.config.drain_grace_s
        while self.admission.num_live and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.admission.num_live
        # A request leaves num_live when its last token is sampled, before its stream has
        # sent it: the RPCs under way get the rest of the grace (at least a second) to end.
        self.stop(grace=max(deadline - time.monotonic(), 1.0))
        return left

    def _serving(self) -> bool:
        return self.loop.failure is None and not self.servicer.draining

    def _expire_loop(self) -> None:
        """Frees quarantined blocks and fails overdue tickets even when no RPC arrives."""
        while not self._stop.wait(0.2):
            self.admission.expire()


def cli_parser() -> argparse.ArgumentParser:
    """The decode server's command line (also what deploy/ manifests are checked against)."""
    parser = argparse.ArgumentParser(prog="python -m decode.server", description=__doc__)
    DecodeServerConfig.add_cli_args(parser)
    registration.add_cli_args(parser)
    preflight.add_cli_args(parser)
    return parser


def main() -> None:
    args = cli_parser().parse_args()
    preflight.check_server(args, "decode.server")
    try:
        registration.check_args(args)
        server = DecodeServer(DecodeServerConfig.from_cli_args(args))
        server.start()
    except (ValueError, OSError, FileNotFoundError) as e:
        sys.exit(f"decode.server: cannot start: {e}")
    metrics = f", metrics on :{server.metrics_port}" if server.metrics_port else ""
    print(f"decode.server: serving gRPC on {args.host}:{server.port}{metrics}", flush=True)
    routers = registration.Registration.from_args(args, "decode", server.port, "decode.server")
    routers.start()
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    try:
        terminated.wait()
    except KeyboardInterrupt:
        server.stop()
        return
    # Routers first: each answers once nothing it sent is still on its way here.
    routers.withdraw()
    print("decode.server: draining (SIGTERM): new requests refused", flush=True)
    left = server.drain()
    refused = server.servicer.drain_refusals
    print(f"decode.server: stopped, {left} request(s) cut at the end of the grace, {refused} "
          "refused while draining", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
