"""Preflight: does this host have what a server's configuration needs? Each failure is one line
naming what is wrong and the setting or command that fixes it.

    python -m tools.preflight --transport nixl --device cuda --model DIR --host 10.0.0.5

The decode and prefill servers run the same checks for their own configuration before they
start (`enforce`): with `--preflight error`, their default, a failure stops the server with its
lines; `--preflight warn` logs them and goes on. A misconfiguration then surfaces at start-up,
not as a slow or failing KV transfer.

What is checked, and when:
- the model: a Hugging Face folder whose config.json tandem reads, or a known random preset;
- the device: a CUDA device of that index is visible (`--device cuda[:N]`);
- the address: `--host` is one of this machine's (or a wildcard), so peers can reach it;
- RDMA, when a transport that registers memory (nixl, mooncake) would find an RDMA device:
  `ulimit -l` unlimited (pinned memory), RDMAV_FORK_SAFE=1 (the servers start processes),
  transparent huge pages not `never` (an HCA's translation budget runs out at a few GB of 4 KiB
  pages), and UCX_NET_DEVICES naming only devices this host has (left wrong, UCX picks another
  NIC or none: "KV transfer collapses"); `huge_page_backed` checks a registered host buffer.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

INFINIBAND = Path("/sys/class/infiniband")
NET = Path("/sys/class/net")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
REGISTERING = ("nixl", "mooncake")  # transports that register (and with RDMA, pin) memory
MODES = ("error", "warn")
_LOG = logging.getLogger("tandem.preflight")


@dataclass(frozen=True)
class Finding:
    """A failed check: what is wrong, and what fixes it."""

    check: str
    problem: str
    fix: str

    def line(self) -> str:
        return f"preflight {self.check}: {self.problem}; fix: {self.fix}"


def model(name: str) -> Finding | None:
    from engine.config import ModelConfig  # the engine only when a model is checked

    if name.startswith("random:"):
        try:
            ModelConfig.preset(name.removeprefix("random:"))
        except ValueError as e:
            return Finding("model", str(e), "name one of the presets listed")
        return None
    folder = Path(name)
    if not (folder / "config.json").is_file():
        return Finding(
            "model",
            f"{folder} is not a Hugging Face folder (no config.json)",
            "pass --model a Hugging Face model folder, or random:<preset>",
        )
    try:
        ModelConfig.from_hf_folder(folder)
    except (ValueError, KeyError) as e:
        return Finding("model", f"{folder}/config.json: {e}", "serve a supported model")
    return None


def cuda_device(device: str) -> Finding | None:
    if not device.startswith("cuda"):
        return None
    import torch

    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < count:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{count} visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
    return Finding(
        "device",
        f"--device {device} but {seen}",
        "check the driver with nvidia-smi, expose the GPU to the container (--gpus), set "
        "CUDA_VISIBLE_DEVICES, or pass --device cpu",
    )


def bind_address(host: str) -> Finding | None:
    try:
        with socket.create_server((host, 0)):
            return None
    except OSError as e:
        return Finding(
            "host",
            f"cannot listen on {host} ({e.strerror or e})",
            "pass --host an address of this machine (`ip -brief addr`), or 0.0.0.0 and "
            "advertise the routable one",
        )


def rdma_devices(sysfs: Path = INFINIBAND) -> list[str]:
    """This host's RDMA devices (HCAs), by name."""
    return sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []


def memlock(limit: int | None = None) -> Finding | None:
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    if soft == resource.RLIM_INFINITY:
        return None
    return Finding(
        "memlock",
        f"the locked-memory limit is {soft // 1024} KiB; RDMA pins every registered byte",
        "`ulimit -l unlimited` (containers: --ulimit memlock=-1; systemd: LimitMEMLOCK="
        "infinity; Slurm: PropagateResourceLimits=MEMLOCK)",
    )


def fork_safe(env: Mapping[str, str]) -> Finding | None:
    if env.get("RDMAV_FORK_SAFE") == "1" or env.get("IBV_FORK_SAFE") == "1":
        return None
    return Finding(
        "RDMAV_FORK_SAFE",
        "unset, and a process that forks after registering memory corrupts it",
        "export RDMAV_FORK_SAFE=1",
    )


def transparent_huge_pages(path: Path = THP) -> Finding | None:
    if not path.is_file() or "[never]" not in path.read_text():
        return None
    return Finding(
        "huge pages",
        f"{path} is [never]: registered host buffers take 4 KiB pages, and the NIC's "
        "translation budget runs out at a few GB",
        f"echo madvise > {path}",
    )


def ucx_net_devices(
    value: str | None, infiniband: Path = INFINIBAND, net: Path = NET
) -> Finding | None:
    """UCX_NET_DEVICES (e.g. "mlx5_0:1,eth0"): every device it names exists here."""
    if not value or value == "all":
        return None
    missing = []
    for entry in value.split(","):
        name, _, port = entry.strip().partition(":")
        hca = infiniband / name
        ok = (hca / "ports" / port).is_dir() if port else hca.is_dir() or (net / name).exists()
        if not ok:
            missing.append(entry.strip())
    if not missing:
        return None
    have = [
        f"{d}:{p.name}"
        for d in rdma_devices(infiniband)
        for p in (infiniband / d / "ports").iterdir()
    ]
    have += sorted(p.name for p in net.iterdir()) if net.is_dir() else []
    return Finding(
        "UCX_NET_DEVICES",
        f"names {', '.join(missing)}, which this host lacks (it has: {', '.join(have) or 'none'})",
        "set UCX_NET_DEVICES to the RDMA ports the KV should use (`ibv_devinfo`), or unset it",
    )


def huge_page_backed(addr: int, nbytes: int) -> Finding | None:
    """A registered host buffer [addr, addr + nbytes) is backed by huge pages throughout."""
    from transport.memory import huge_bytes_in

    covered = huge_bytes_in(addr, nbytes)
    if covered >= nbytes:
        return None
    return Finding(
        "huge pages",
        f"a registered host buffer of {nbytes} bytes is {covered} bytes huge-page backed",
        f"echo madvise > {THP} (tandem's buffers ask for huge pages), and free memory for "
        "compaction (echo 1 > /proc/sys/vm/compact_memory)",
    )


def server_findings(
    model_name: str, device: str, transport: str, host: str, env: Mapping[str, str] = os.environ
) -> list[Finding]:
    """Every check a server with this configuration needs."""
    found = [model(model_name), cuda_device(device), bind_address(host)]
    found.append(ucx_net_devices(env.get("UCX_NET_DEVICES")) if transport == "nixl" else None)
    if transport in REGISTERING and rdma_devices():
        found += [memlock(), fork_safe(env), transparent_huge_pages()]
    return [f for f in found if f is not None]


def enforce(findings: list[Finding], mode: str, server: str) -> None:
    """`error`: SystemExit with one line a finding; `warn`: each logged as a warning."""
    if not findings:
        return
    if mode == "error":
        sys.exit("\n".join(f"{server}: cannot start: {f.line()} (or --preflight warn)"
                           for f in findings))  # fmt: skip
    for finding in findings:
        _LOG.warning("%s", finding.line())


def check_server(args: argparse.Namespace, server: str) -> None:
    """`enforce` of a server's checks, from its parsed command line: its --preflight mode and
    its engine's and transport's flags."""
    findings = server_findings(args.model, args.device, args.transport, args.host)
    enforce(findings, args.preflight, server)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preflight",
        choices=MODES,
        default="error",
        help="a failed start-up check stops the server (error) or is logged (warn)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.preflight", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="HF folder, or random:<preset>")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    findings = server_findings(args.model, args.device, args.transport, args.host)
    for finding in findings:
        print(finding.line())
    print(f"preflight: {len(findings)} problem(s)" if findings else "preflight: all checks pass")
    sys.exit(1 if findings else 0)


if __name__ == "__main__":
    main()
