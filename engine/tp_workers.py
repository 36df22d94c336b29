"""Tensor-parallel ranks 1..N-1 of an engine as processes, driven by rank 0.

Rank 0 (the engine's own process) starts one process per other rank; the ranks meet in a
torch.distributed group (NCCL on CUDA, gloo on CPU) for the model's collectives, plus a gloo
group on which rank 0 sends every device call of a step (engine/step_executor.py) before making
it itself. Each rank builds the engine's parts over its share of the model (the same block
count, the same graphs) and then only runs what rank 0 sends: the scheduler, the sampler and
every sequence live on rank 0.

A rank that exits fails the engine: rank 0's collectives with it raise (its sockets close), and
`check_alive`, called by the engine's thread between steps, raises when no step is running. A
rank whose rank 0 exits exits too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from engine.cuda_graphs import GraphStep
from engine.engine_config import EngineConfig
from engine.model_loader import Backend, read_model_config
from engine.step_executor import StepExecutor
from engine.tensor_parallel import TpRank, TpShape, check_supported

STARTUP_TIMEOUT_S = 300.0
"""How long rank 0 waits for a rank to join, then to build its parts (load its weights)."""
MODEL_COLLECTIVE_TIMEOUT = timedelta(seconds=120)
"""How long the model's collectives wait for a peer: ranks do the same work in a step, so a
rank this late has hung (a rank that dies is noticed at once, by its closed sockets)."""
# The control group's calls wait for rank 0's next one: as long as the server is idle.
_CONTROL_TIMEOUT = timedelta(days=365)


class RankAgent(Protocol):
    """What a server runs in each rank > 0 besides the model: e.g. the transport its share of
    the KV cache is registered with (decode), or the sender of its KV heads (prefill). Made in
    the rank by a picklable factory (an AgentFactory, given the rank); rank 0 calls its other
    methods by name (`TpWorkers.call_agents`), in order with the step's device work."""

    def wrap_attention(self, backend: Backend) -> Backend:
        """Decorates the rank's attention backend (LLMEngine.build's `wrap_attention`)."""
        ...

    def ready(self, executor: StepExecutor, store: dist.Store) -> Any:
        """Once the rank's parts are built; the result reaches rank 0 in `TpWorkers.infos`.
        `store`: the ranks' key-value store (`TpWorkers.store`), e.g. to report to rank 0."""
        ...

    def close(self) -> None:
        """When the rank stops."""
        ...


AgentFactory = Callable[[int], RankAgent]


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: the rank-th CUDA device from `device`'s, or the CPU."""
    if device == "cpu":
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def _check_devices(config: EngineConfig) -> None:
    """ValueError when the machine lacks a CUDA device for every rank."""
    if config.device == "cpu":
        return
    last = rank_device(config.device, config.tensor_parallel_size - 1)
    count = torch.cuda.device_count()
    if int(last.partition(":")[2]) >= count:
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size} on {config.device} needs "
            f"devices up to {last}; this machine has {count} CUDA device(s)"
        )


def _init_group(
    config: EngineConfig, rank: int, store: dist.Store
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(the model's group, the control group) of this process as `rank` (its CUDA device
    already set)."""
    cuda = config.device.startswith("cuda")
    size = config.tensor_parallel_size
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=MODEL_COLLECTIVE_TIMEOUT
    )
    return dist.group.WORLD, dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


class TpWorkers:
    """Rank 0's handle on the other ranks."""

    def __init__(
        self,
        procs: list[subprocess.Popen],
        store: dist.TCPStore,
        tp: TpRank,
    ) -> None:
        self.tp = tp
        """Rank 0's shape and groups."""
        self._procs = procs
        self.store = store
        """The ranks' key-value store."""
        self.infos: list[Any] = []
        """What each rank > 0's agent's `ready` returned, in rank order (after
        `leader_executor`)."""

    @classmethod
    def start(cls, config: EngineConfig, agent: AgentFactory | None = None) -> TpWorkers:
        """Starts ranks 1..N-1 and joins them into the groups as rank 0. ValueError when the
        model does not split over the ranks, or the machine lacks their GPUs (before anything
        starts)."""
        model_config = read_model_config(config)
        size = config.tensor_parallel_size
        check_supported(model_config, size)
        _check_devices(config)
        if config.device.startswith("cuda"):
            torch.cuda.set_device(config.device)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        # A process of its own, not multiprocessing's spawn: that re-imports the caller's main
        # module, which a script without a __main__ guard would run again in every rank.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        procs = []
        for rank in range(1, size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.tp_workers"], stdin=subprocess.PIPE, env=env
            )
            proc.stdin.write(pickle.dumps((config, rank, store.port, agent, os.getpid())))
            proc.stdin.close()
            procs.append(proc)
        try:
            _wait_for(store, procs, "joined", "before joining")
            group, control = _init_watched(config, store, procs)
        except BaseException:
            _kill(procs)
            raise
        return cls(procs, store, TpRank(TpShape(model_config, 0, size), group, control))

    def leader_executor(self, local: StepExecutor) -> LeaderExecutor:
        """Rank 0's executor over its own parts, once every other rank has built its parts
        (RuntimeError naming the first that could not)."""
        _wait_for(self.store, self._procs, "ready", "before building its part of the model")
        for rank in range(1, len(self._procs) + 1):
            kind, value = pickle.loads(self.store.get(f"ready/{rank}"))
            if kind == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} could not start: {value}")
            self.infos.append(value)
        return LeaderExecutor(local, self)

    def send(self, op: str, args: tuple) -> None:
        """Has every other rank call its executor's `op(*args)`; a rank that has exited is
        named (its sockets closed: the broadcast fails)."""
        try:
            dist.broadcast_object_list([(op, args)], src=0, group=self.tp.control)
        except RuntimeError as error:
            self.raise_if_one_exits(error)
            raise

    def call_agents(self, method: str, *args: Any) -> None:
        """Has every other rank's agent call `method(*args)`."""
        self.send("agent", (method, *args))

    def check_alive(self) -> None:
        """RuntimeError naming a rank that has exited."""
        for rank, proc in enumerate(self._procs, 1):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} {_ended(proc)}: the engine's state is lost"
                )

    def raise_if_one_exits(self, error: Exception, wait_s: float = 2.0) -> None:
        """Raises check_alive's error, from `error`, if a rank has exited or does within
        wait_s (a collective fails as soon as a rank's sockets close, just before its exit)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.check_alive()
            except RuntimeError as exited:
                raise exited from error
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def stop(self) -> None:
        """Ends every other rank (asks them, then kills what is left) and leaves the groups."""
        if all(proc.poll() is None for proc in self._procs):
            with contextlib.suppress(RuntimeError):  # a rank went away meanwhile: killed below
                self.send("stop", ())
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        _kill(self._procs)
        if dist.is_initialized():
            dist.destroy_process_group()


class LeaderExecutor(StepExecutor):
    """Rank 0's StepExecutor: each call is sent to every other rank, then made here."""

    def __init__(self, local: StepExecutor, workers: TpWorkers) -> None:
        super().__init__(local.model, local.kv_cache, local.graphs, local.verify_graphs)
        self._workers = workers
        self.group = workers.tp.group

    def forward(self, input_ids, positions, query_lens, seq_lens, block_tables) -> torch.Tensor:
        args = (list(positions), list(query_lens), list(seq_lens), [list(t) for t in block_tables])
        if isinstance(input_ids, torch.Tensor):  # a step planned ahead: the ids on the device
            self._workers.send("forward_fed", args)
            dist.broadcast(input_ids, src=0, group=self.group)
        else:
            input_ids = list(input_ids)
            self._workers.send("forward", (input_ids, *args))
        return super().forward(input_ids, *args)

    def logits(self, rows: Sequence[int]) -> torch.Tensor:
        self._workers.send("logits", (list(rows),))
        return super().logits(rows)

    def replay(
        self,
        verify,
        input_ids,
        positions,
        block_tables,
        row_in_seq=None,
        fed_ids=None,
        offsets=None,
    ) -> GraphStep:
        # The engine plans no shifted verification under tensor parallelism (LLMEngine.build).
        assert offsets is None, "offsets on the device: one device only"
        ids = None if input_ids is None else list(input_ids)
        rows = None if row_in_seq is None else list(row_in_seq)
        args = (verify, ids, list(positions), [list(t) for t in block_tables], rows)
        if fed_ids is not None:  # a step planned ahead: the ids on the device
            self._workers.send("replay_fed", args)
            dist.broadcast(fed_ids, src=0, group=self.group)
        else:
            self._workers.send("replay", args)
        return super().replay(*args, fed_ids=fed_ids)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self._workers.send("copy_blocks", (list(src), list(dst)))
        super().copy_blocks(src, dst)


class RankExecutor(StepExecutor):
    """A rank > 0's StepExecutor: also takes the calls whose input ids rank 0 broadcasts (a step
    planned ahead feeds the tokens the step before it sampled, still on rank 0's device)."""

    def __init__(self, local: StepExecutor, group: dist.ProcessGroup) -> None:
        super().__init__(local.model, local.kv_cache, local.graphs, local.verify_graphs)
        self.group = group

    def forward_fed(self, positions, query_lens, seq_lens, block_tables) -> None:
        self.forward(self._fed(len(positions)), positions, query_lens, seq_lens, block_tables)

    def replay_fed(self, verify, input_ids, positions, block_tables, row_in_seq) -> None:
        fed = self._fed(len(positions))
        self.replay(verify, input_ids, positions, block_tables, row_in_seq, fed_ids=fed)

    def _fed(self, n: int) -> torch.Tensor:
        ids = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(ids, src=0, group=self.group)
        return ids


def _init_watched(
    config: EngineConfig, store: dist.TCPStore, procs: list[subprocess.Popen]
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Rank 0's _init_group, in a thread of its own: a rank that exits while the groups form
    would leave it waiting for good; this raises naming that rank instead (the thread is left
    blocked, and the engine fails to start)."""
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(_init_group(config, 0, store)),
        name="tp-init",
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while thread.is_alive():
        thread.join(timeout=0.05)
        for rank, proc in enumerate(procs, 1):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} {_ended(proc)} while joining")
    if not result:
        raise RuntimeError("tensor-parallel: rank 0 could not join its ranks (see its log)")
    return result[0]


def _wait_for(store: dist.TCPStore, procs: list[subprocess.Popen], key: str, stage: str) -> None:
    """Waits until every rank has set `key/<rank>` in the store; RuntimeError naming one that
    exited or did not within STARTUP_TIMEOUT_S."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for rank, proc in enumerate(procs, 1):
        while not store.check([f"{key}/{rank}"]):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} {_ended(proc)} {stage}")
            time.sleep(0.02)


def _ended(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        return f"did not answer within {STARTUP_TIMEOUT_S:g} s"
    return f"exited (exit code {proc.returncode})"


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _rank_main(
    config: EngineConfig, rank: int, port: int, factory: AgentFactory | None, parent: int
) -> None:
    """A rank > 0's process: joins, builds its parts, then runs rank 0's calls until "stop"."""
    from engine.engine_parts import build_parts  # the model code: not needed by rank 0's import

    _exit_with_parent(parent)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank_device(config.device, rank))
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False)
    store.set(f"joined/{rank}", "1")
    group, control = _init_group(config, rank, store)
    rank_config = dataclasses.replace(config, device=rank_device(config.device, rank))
    agent = None
    try:
        agent = None if factory is None else factory(rank)
        wrap = None if agent is None else agent.wrap_attention
        shape = TpShape(read_model_config(config), rank, config.tensor_parallel_size)
        parts = build_parts(rank_config, wrap, TpRank(shape, group, control))
        executor = RankExecutor(parts.executor, group)
        info = None if agent is None else agent.ready(executor, store)
    except Exception as error:
        store.set(f"ready/{rank}", pickle.dumps(("error", f"{type(error).__name__}: {error}")))
        raise
    store.set(f"ready/{rank}", pickle.dumps(("ready", info)))
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        op, args = box[0]
        if op == "stop":
            break
        if op == "agent":
            getattr(agent, args[0])(*args[1:])
        else:
            getattr(executor, op)(*args)
    dist.destroy_process_group()
    if agent is not None:
        agent.close()


def _exit_with_parent(parent: int) -> None:
    """Exits this process as soon as rank 0's has (a rank alone only waits)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


if __name__ == "__main__":
    _rank_main(*pickle.load(sys.stdin.buffer))
