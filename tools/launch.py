"""Starting tandem's servers as child processes, waiting until each says it serves."""

from __future__ import annotations

import collections
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

LAST_LINES = 200
"""Of a started child's output, what `proc.last_lines` keeps (e.g. what it said on exit)."""


def start(
    args: list[str], ready: str, timeout: float = 120, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, re.Match]:
    """Runs `python -m ARGS...` (after `prefix`, e.g. `ip netns exec NS`) and waits for a stdout
    line matching `ready`. The child's output goes on being read into `proc.last_lines`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR"}
    env.update(NIXL_LOG_LEVEL="WARN", UCX_LOG_FILE="stderr")
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    last = proc.last_lines = collections.deque(maxlen=LAST_LINES)
    lines: queue.Queue[str | None] = queue.Queue()
    waiting = threading.Event()
    waiting.set()

    def read() -> None:
        """Drains the child's output for as long as it runs (a full pipe would block it):
        the last lines kept, and handed to the wait below until the child is ready."""
        for line in proc.stdout:
            last.append(line)
            if waiting.is_set():
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        return proc, _wait_ready(proc, args[0], ready, timeout, lines)
    except BaseException:  # not ready, or the caller stopped while waiting (exit_on_sigterm)
        stop([proc], grace=0)
        raise
    finally:
        waiting.clear()


def _wait_ready(
    proc: subprocess.Popen, name: str, ready: str, timeout: float, lines: queue.Queue
) -> re.Match:
    """The match of the first line matching `ready`; RuntimeError if the child exits first or
    `timeout` seconds pass (whether or not it prints anything meanwhile)."""
    deadline = time.monotonic() + timeout
    said = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            proc.wait()
            raise RuntimeError(f"{name} exited with {proc.returncode}: {''.join(said)}")
        said.append(line)
        if match := re.search(ready, line):
            return match
    raise RuntimeError(f"{name} not ready in {timeout} s: {''.join(said)}")


def stop(procs: list[subprocess.Popen], grace: float = 30) -> None:
    """SIGTERM to each child still running, then SIGKILL to those not gone `grace` seconds
    later (a server drains first: 30 s is its default grace)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def exit_on_sigterm() -> None:
    """SIGTERM (`timeout`, a job scheduler) raises SystemExit in the main thread, so that the
    `finally` blocks that stop a tool's children run: by default it ends the process at once
    and leaves the servers it started running, holding their ports and GPU memory."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
