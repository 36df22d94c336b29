"""tandem under a real Slurm (Debian's slurmctld, slurmd and munge, started by this test as root
on this machine: its own config, ports and state in a temporary folder):
`sbatch tools/slurm/tandem.sbatch` starts decode, prefill and router as job steps, the router
serves a greedy completion, `scancel` ends the job and leaves none of its processes running. A
job whose server cannot start fails with a line naming it, and leaves nothing running either.
On one node (this host's loopback), and on two nodes that are hosts of their own (a slurmd in
each of two network namespaces, each with its own address): the decode server on one, the
prefill server on the other.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.netns import Network
from tests.servers import MODEL

SBATCH = Path("tools/slurm/tandem.sbatch")


def _daemon(name: str) -> str:
    """A daemon's path: on PATH, or in /usr/sbin (test environments leave it off PATH)."""
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {timeout} s")


@contextlib.contextmanager
def _cluster(nodes: list[tuple[str, str, tuple[str, ...]]], controller: str):
    """A cluster of `nodes` (name, address, the prefix that runs a command on it): munged,
    slurmctld on `controller`'s address and a slurmd per node, on free ports; yields the
    clients' environment (SLURM_CONF). Stopped, and its folder removed, at the end. The folder
    is short-named under /tmp: munge's socket path must fit 108 bytes, which a test's own
    temporary folder can exceed."""
    root = Path(tempfile.mkdtemp(prefix="tandem-slurm-", dir="/tmp"))
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    node_lines = [f"NodeName={name} NodeAddr={address} CPUs={os.cpu_count()} State=UNKNOWN"
                  for name, address, _ in nodes]  # fmt: skip
    conf.write_text(
        "\n".join(
            [
                "ClusterName=tandemtest",
                f"SlurmctldHost={host}({controller})",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={root}/munge.sock",
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool/%n",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd-%n.pid",
                f"SlurmctldLogFile={root}/log/slurmctld.log",
                f"SlurmdLogFile={root}/log/slurmd-%n.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "MpiDefault=none",
                "ReturnToService=2",
                "JobAcctGatherType=jobacct_gather/none",
                "KillWait=10",
                *node_lines,
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pid_files = [root / "slurmctld.pid", *(root / f"slurmd-{name}.pid" for name, _, _ in nodes)]
    try:  # from the first daemon on: whatever fails, every daemon started is stopped
        subprocess.run(
            [_daemon("munged"), "--force", f"--socket={root}/munge.sock", f"--key-file={key}",
             f"--pid-file={root}/munged.pid", f"--log-file={root}/log/munged.log",
             f"--seed-file={root}/munge.seed"],
            check=True, env=env,
        )  # fmt: skip
        subprocess.run([_daemon("slurmctld"), "-f", str(conf)], check=True, env=env)
        for name, _, prefix in nodes:
            (root / "spool" / name).mkdir()
            done = subprocess.run([*prefix, _daemon("slurmd"), "-f", str(conf), "-N", name],
                                  env=env, capture_output=True, text=True)  # fmt: skip
            log = root / "log" / f"slurmd-{name}.log"
            assert done.returncode == 0, (done.stderr, log.exists() and log.read_text()[-2000:])
        idle = ["idle", str(len(nodes))]  # one line: the state, how many nodes are in it
        _wait(lambda: _out(["sinfo", "-h", "-o", "%T %D"], env).split() == idle, 60,
              f"{len(nodes)} node(s) idle")  # fmt: skip
        yield env
    finally:
        for pid_file in [*pid_files, root / "munged.pid"]:
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], check=False)
        _wait(lambda: not any(f.exists() for f in pid_files), 30, "the daemons stopped")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm():
    """One node, on this host's loopback."""
    with _cluster([("tandem-node", "127.0.0.1", ())], "127.0.0.1") as env:
        yield env


@pytest.fixture(scope="module")
def two_nodes():
    """Two nodes, each a host of its own (a network namespace with its own address); the
    controller on this test's host. Yields (the clients' environment, the network)."""
    network = Network("ts", {"node1": 1, "node2": 2})
    network.make()
    try:
        nodes = [(f"tandem-{host}", network.address(host), network.on(host, own_sysfs=False))
                 for host in ("node1", "node2")]  # fmt: skip
        with _cluster(nodes, network.test_address) as env:
            yield env, network
    finally:
        network.remove()


def _out(command: list[str], env: dict) -> str:
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False).stdout


def _submit(env: dict, log_dir: Path, *args: str, nodes: int = 1) -> str:
    """sbatch of the recipe from the tandem checkout (this test's working folder) on `nodes`
    nodes; its job id."""
    out = _out(
        ["sbatch", "--parsable", f"--nodes={nodes}", f"--output={log_dir}/job.out",
         f"--chdir={os.getcwd()}", str(SBATCH), "--model", MODEL, "--dtype", "float32",
         "--kv-cache-gb", "0.1", "--port", "0", "--log-dir", str(log_dir), *args],
        {**env, "TANDEM_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert re.fullmatch(r"\d+\s*", out), out
    return out.strip()


def _job_processes(job_id: str) -> list[int]:
    """Processes whose environment says they belong to the job."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if f"SLURM_JOB_ID={job_id}".encode() in environ.split(b"\0"):
                found.append(int(entry.name))
    return found


def _gone(env: dict, job_id: str) -> bool:
    return not _out(["squeue", "-h", "-j", job_id], env).strip() and not _job_processes(job_id)


def test_sbatch_serves_through_the_router_and_scancel_leaves_nothing(slurm, tmp_path):
    job = _submit(slurm, tmp_path)
    url_file = tmp_path / "router_url"
    url = _wait(lambda: url_file.exists() and url_file.read_text().strip(), 240, "router_url")
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    logs = {p.name for p in tmp_path.glob("*.log")}
    assert logs == {"decode-0.log", "prefill-0.log", "router.log"}
    assert "tandem ready: http://" in (tmp_path / "job.out").read_text()
    subprocess.run(["scancel", job], check=True, env=slurm)
    _wait(lambda: _gone(slurm, job), 60, "the job and its processes gone")


def test_a_server_that_cannot_start_fails_the_job_naming_it(slurm, tmp_path):
    job = _submit(slurm, tmp_path, "--decode-arg=--block-size=0")
    _wait(lambda: _gone(slurm, job), 120, "the failed job gone")
    out = (tmp_path / "job.out").read_text()
    assert "tandem: cannot start: decode-0 on tandem-node exited with" in out, out
    assert "block_size" in out, out


def test_two_nodes_each_server_on_its_own_host(two_nodes, tmp_path):
    """The decode server on the first node, the prefill on the second, each bound to its own
    host's address, the router on the first: a greedy completion from the test's host goes
    across them (the KV from the second host to the first); scancel stops both nodes' steps."""
    env, network = two_nodes
    job = _submit(env, tmp_path, nodes=2)
    url_file = tmp_path / "router_url"
    url = _wait(lambda: url_file.exists() and url_file.read_text().strip(), 240, "router_url")
    first, second = network.address("node1"), network.address("node2")
    assert url.startswith(f"http://{first}:")
    assert f"serving gRPC on {first}:" in (tmp_path / "decode-0.log").read_text()
    assert f"serving on http://{second}:" in (tmp_path / "prefill-0.log").read_text()
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    subprocess.run(["scancel", job], check=True, env=env)
    _wait(lambda: _gone(env, job), 60, "the job and its processes gone")
