"""tandem on a Slurm job's nodes: decode servers, prefill servers and the router, one job step
each (`srun --overlap`), placed on the job's nodes in turn, each bound to its node's address.

    sbatch --nodes=2 tools/slurm/tandem.sbatch --model /models/llama --device cuda \
        --decode-nodes 1 --prefill-nodes 1 --transport nixl

Decode servers take the first nodes, prefill servers the next ones (wrapping around when there
are more servers than nodes), the router the job's first node. Every server picks a free port
and says which in its log (`<log dir>/<name>.log`); the launcher reads it there and hands the
addresses on: prefill and decode first, then the router with all of them. Once the router
serves, its URL is printed ("tandem ready: http://ADDR:PORT") and written to
`<log dir>/router_url`. A server that exits, or is not ready within --ready-timeout, fails the
job with a line naming it and the end of its log; the others are stopped. `scancel` (SIGTERM)
stops every step: each server drains (decode servers within their --drain-grace-s), then the job
ends.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

READY = {
    "decode.server": r"serving gRPC on ([\w.:-]+)",
    "prefill.server": r"serving on (http://[\w.:-]+)",
    "router.server": r"serving on (http://[\w.:-]+)",
}


@dataclass
class Step:
    name: str
    node: str
    proc: subprocess.Popen
    log: Path


class LaunchError(Exception):
    pass


CANCELLED = threading.Event()
"""Set by SIGTERM (scancel) or SIGINT: start-up stops waiting, supervision ends."""


def job_nodes() -> list[tuple[str, str]]:
    """(node name, address) of each node of the job, in Slurm's order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM_JOB_NODELIST is not set: run this inside a job (sbatch)")
    names = _run(["scontrol", "show", "hostnames", nodelist]).split()
    return [(name, node_address(name)) for name in names]


def node_address(name: str) -> str:
    """The node's NodeAddr as Slurm knows it (its name when Slurm has no other)."""
    shown = _run(["scontrol", "show", "node", "-o", name])
    match = re.search(r"\bNodeAddr=(\S+)", shown)
    return match.group(1) if match else name


def start_step(
    name: str, node: str, module: str, args: list[str], log_dir: Path, python: str
) -> Step:
    log = log_dir / f"{name}.log"
    command = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
               f"--job-name={name}", f"--output={log}", "--unbuffered",
               python, "-m", module, *args]  # fmt: skip
    return Step(name, node, subprocess.Popen(command, stdin=subprocess.DEVNULL), log)


def wait_ready(step: Step, pattern: str, deadline: float, others: list[Step]) -> str:
    """The first group of `pattern` in the step's log, once it appears; LaunchError when the
    step, or one started before it, exits first or the deadline passes."""
    while time.monotonic() < deadline and not CANCELLED.is_set():
        text = step.log.read_text(errors="replace") if step.log.exists() else ""
        if match := re.search(pattern, text):
            return match.group(1)
        for other in [step, *others]:
            if other.proc.poll() is not None:
                raise LaunchError(_exited(other))
        time.sleep(0.2)
    if CANCELLED.is_set():
        raise LaunchError("cancelled while starting")
    raise LaunchError(f"{step.name} on {step.node} not ready in time; {_tail(step)}")


def launch(args: argparse.Namespace, steps: list[Step], python: str = sys.executable) -> None:
    """Starts every server and the router, each step appended to `steps` as it starts; returns
    once all are ready."""
    nodes = job_nodes()
    log_dir = Path(args.log_dir or f"tandem-{os.environ.get('SLURM_JOB_ID', 'local')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.ready_timeout
    engine = ["--model", args.model, "--dtype", args.dtype, "--device", args.device,
              "--kv-cache-gb", str(args.kv_cache_gb), "--transport", args.transport]  # fmt: skip
    decodes, prefills = [], []
    for i in range(args.decode_nodes):
        node, address = nodes[i % len(nodes)]
        step = start_step(f"decode-{i}", node, "decode.server",
                          [*engine, "--host", address, "--grpc-port", "0", *args.decode_arg],
                          log_dir, python)  # fmt: skip
        steps.append(step)
        decodes.append(step)
    for i in range(args.prefill_nodes):
        node, address = nodes[(args.decode_nodes + i) % len(nodes)]
        step = start_step(f"prefill-{i}", node, "prefill.server",
                          [*engine, "--host", address, "--port", "0", *args.prefill_arg],
                          log_dir, python)  # fmt: skip
        steps.append(step)
        prefills.append(step)
    router_args = ["--model", args.model, "--host", nodes[0][1], "--port", str(args.port)]
    for step in decodes:
        router_args += ["--decode", wait_ready(step, READY["decode.server"], deadline, steps)]
    for step in prefills:
        router_args += ["--prefill", wait_ready(step, READY["prefill.server"], deadline, steps)]
    router = start_step("router", nodes[0][0], "router.server", [*router_args, *args.router_arg],
                        log_dir, python)  # fmt: skip
    steps.append(router)
    url = wait_ready(router, READY["router.server"], deadline, steps)
    (log_dir / "router_url").write_text(url + "\n")
    print(f"tandem ready: {url} (logs in {log_dir})", flush=True)


def supervise(steps: list[Step]) -> int:
    """Waits until a step exits (1: the job fails, naming it) or the job is cancelled (0)."""
    while not CANCELLED.wait(0.5):
        for step in steps:
            if step.proc.poll() is not None:
                print(f"tandem: {_exited(step)}", file=sys.stderr, flush=True)
                return 1
    return 0


def stop_all(steps: list[Step], grace: float) -> None:
    """SIGTERM to every step (srun passes it to its server, which drains), then SIGKILL to any
    left after `grace` seconds."""
    for step in steps:
        if step.proc.poll() is None:
            step.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for step in steps:
        try:
            step.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            step.proc.kill()
            step.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.slurm.launch", description=__doc__)
    parser.add_argument("--model", required=True, help="HF folder (on every node) or random:…")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--transport", default="tcp", help="nixl, mooncake, tcp")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--decode-nodes", type=int, default=1, help="decode servers")
    parser.add_argument("--prefill-nodes", type=int, default=1, help="prefill servers")
    parser.add_argument("--port", type=int, default=8000, help="the router's")
    parser.add_argument("--ready-timeout", type=float, default=600, help="seconds, all servers")
    parser.add_argument("--stop-grace", type=float, default=40, help="seconds after SIGTERM")
    parser.add_argument("--log-dir", default=None, help="default: ./tandem-$SLURM_JOB_ID")
    for part in ("decode", "prefill", "router"):
        parser.add_argument(
            f"--{part}-arg",
            action="append",
            default=[],
            help=f"one more argument for every {part} server, as --{part}-arg=--flag (repeatable)",
        )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: CANCELLED.set())
    signal.signal(signal.SIGINT, lambda *_: CANCELLED.set())
    steps: list[Step] = []
    try:
        launch(args, steps)
        status = supervise(steps)
    except LaunchError as e:
        print(f"tandem: cannot start: {e}", file=sys.stderr, flush=True)
        status = 1
    finally:
        stop_all(steps, args.stop_grace)
    sys.exit(status)


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LaunchError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return done.stdout


def _exited(step: Step) -> str:
    return f"{step.name} on {step.node} exited with {step.proc.returncode}; {_tail(step)}"


def _tail(step: Step, lines: int = 5) -> str:
    text = step.log.read_text(errors="replace") if step.log.exists() else ""
    last = " | ".join(text.strip().splitlines()[-lines:])
    return f"its log ({step.log}) ends: {last}" if last else f"its log ({step.log}) is empty"


if __name__ == "__main__":
    main()
