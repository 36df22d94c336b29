"""Starting tandem's servers as child processes, waiting until each says it serves."""

from __future__ import annotations

import collections
import os
import re
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
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            raise RuntimeError(f"{args[0]} exited with {proc.returncode}: {''.join(lines)}")
        lines.append(line)
        if match := re.search(ready, line):
            # Kept draining (a full pipe would block the child); the last lines kept.
            last = proc.last_lines = collections.deque(lines, maxlen=LAST_LINES)
            threading.Thread(target=last.extend, args=(proc.stdout,), daemon=True).start()
            return proc, match
    proc.kill()
    raise RuntimeError(f"{args[0]} not ready in {timeout} s: {''.join(lines)}")
