"""tandem under a real Slurm (Debian's slurmctld, slurmd and munge, started by this test as root
on this machine: one node, its own config, ports and state in a temporary folder):
`sbatch tools/slurm/tandem.sbatch` starts decode, prefill and router as job steps, the router
serves a greedy completion, `scancel` ends the job and leaves none of its processes running. A
job whose server cannot start fails with a line naming it, and leaves nothing running either.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def slurm():
    """A one-node cluster: munged, slurmctld and slurmd on free ports; SLURM_CONF for the
    clients. Stopped, and its folder removed, at the end. The folder is short-named under /tmp:
    munge's socket path must fit 108 bytes, which a test's own temporary folder can exceed."""
    root = Path(tempfile.mkdtemp(prefix="tandem-slurm-", dir="/tmp"))
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=tandemtest",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={root}/munge.sock",
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd.pid",
                f"SlurmctldLogFile={root}/log/slurmctld.log",
                f"SlurmdLogFile={root}/log/slurmd.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "MpiDefault=none",
                "ReturnToService=2",
                "JobAcctGatherType=jobacct_gather/none",
                "KillWait=10",
                f"NodeName=tandem-node NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(
        [_daemon("munged"), "--force", f"--socket={root}/munge.sock", f"--key-file={key}",
         f"--pid-file={root}/munged.pid", f"--log-file={root}/log/munged.log",
         f"--seed-file={root}/munge.seed"],
        check=True, env=env,
    )  # fmt: skip
    subprocess.run([_daemon("slurmctld"), "-f", str(conf)], check=True, env=env)
    subprocess.run([_daemon("slurmd"), "-f", str(conf), "-N", "tandem-node"], check=True, env=env)
    try:
        _wait(lambda: "idle" in _out(["sinfo", "-h", "-o", "%T"], env), 60, "the node idle")
        yield env
    finally:
        for daemon in ("slurmd", "slurmctld", "munged"):
            pid_file = root / f"{daemon}.pid"
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], check=False)
        _wait(lambda: not any((root / f"{d}.pid").exists() for d in ("slurmd", "slurmctld")),
              30, "the daemons stopped")  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


def _out(command: list[str], env: dict) -> str:
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False).stdout


def _submit(env: dict, log_dir: Path, *args: str) -> str:
    """sbatch of the recipe from the tandem checkout (this test's working folder); its job id."""
    out = _out(
        ["sbatch", "--parsable", f"--output={log_dir}/job.out", f"--chdir={os.getcwd()}",
         str(SBATCH), "--model", MODEL, "--dtype", "float32", "--kv-cache-gb", "0.1",
         "--port", "0", "--log-dir", str(log_dir), *args],
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
