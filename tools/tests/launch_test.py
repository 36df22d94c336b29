"""Starting and stopping tandem's servers as child processes (tools/launch.py), with stand-in
children: small Python modules written by the test, run as `python -m` as the servers are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tools.launch import start, stop

# Ignores SIGTERM, as a server stuck in its drain would.
STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", os.getpid(), flush=True)
time.sleep(600)
"""
# A tool that starts a child and stops it in `finally` (tools.handover_bench's shape).
TOOL = """
import time
from tools.launch import exit_on_sigterm, start, stop
exit_on_sigterm()
child, _ = start(["stubborn"], "ready")
try:
    print(child.pid, flush=True)
    time.sleep(600)
finally:
    stop([child], grace=0.5)
"""


@pytest.fixture
def modules(tmp_path, monkeypatch):
    for name, text in (("stubborn", STUBBORN), ("tool", TOOL)):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    path = os.pathsep.join(filter(None, [str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)


def _gone(pid: int, within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(modules):
    child, _ = start(["stubborn"], "ready")
    started = time.monotonic()
    stop([child], grace=0.5)
    assert child.returncode == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - started < 5


def test_a_tool_stopped_by_sigterm_stops_the_servers_it_started(modules):
    tool = subprocess.Popen([sys.executable, "-m", "tool"], stdout=subprocess.PIPE, text=True)
    child = int(tool.stdout.readline())
    tool.send_signal(signal.SIGTERM)  # as `timeout` does
    assert tool.wait(timeout=10) == 128 + signal.SIGTERM
    assert _gone(child)


def test_a_child_silent_past_its_timeout_is_refused_and_not_left_running(modules):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"stubborn not ready in 0\.5 s: ready (\d+)") as e:
        start(["stubborn"], "a line it never prints", timeout=0.5)
    assert time.monotonic() - started < 5  # it said nothing more, and was not waited on
    assert _gone(int(e.value.args[0].split()[-1]))
