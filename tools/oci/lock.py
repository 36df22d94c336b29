"""Writes the images' Python locks: per target, what the services import at run time, pinned
exactly with sha256 hashes, resolved by pip for the target's platform and Python.

    .venv/bin/python -m tools.oci.lock cpu|cuda|rocm   (from the repo root; commit the results)
    .venv/bin/python -m tools.oci.lock --check TARGET  (resolves the locks again, changes nothing)

Each target gets two locks, one image layer each, so that the router image carries no torch:
  images/TARGET/router.lock  images/requirements-router.in (tokenizer, HTTP, gRPC, metrics)
  images/TARGET/engine.lock  images/TARGET/requirements-engine.in (torch, ...) minus router.lock
Versions tandem's dev venv also has are held to the dev lock's (requirements.lock), so the images
run what CI tests; `unconstrained` names the packages a target's torch build pins differently.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tools.lock import lock_lines, requirement_lines, resolve_with_pip
from tools.oci.build import MANYLINUX

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"


@dataclass(frozen=True)
class Target:
    python: str
    """The base image's CPython (major.minor): the wheels' tags."""
    machine_index: bool
    """True: pip's configuration on this machine (the CPU torch build lies in its wheel folder);
    False: PyPI alone (no local builds, whatever this machine's pip is configured with)."""
    unconstrained: frozenset[str] = frozenset()
    extra_index: str = ""
    unresolvable: str = ""
    """Requirements that cannot be resolved from here, and why: written into the lock, whose
    layer then refuses to build."""


TARGETS = {
    "cpu": Target("3.11", machine_index=True),
    # torch 2.13.0 from PyPI is the CUDA 13 build; it pins its own triton.
    "cuda": Target("3.12", machine_index=False, unconstrained=frozenset({"triton"})),
    # NOTE: PyTorch's ROCm builds are published only on the PyTorch wheel index, not on PyPI.
    "rocm": Target(
        "3.12",
        machine_index=False,
        unconstrained=frozenset({"triton"}),
        unresolvable="torch==2.13.0 (ROCm build) and its pytorch-triton-rocm: published only "
        "on the PyTorch ROCm wheel index (download.pytorch.org/whl/rocm*), which this "
        "machine cannot reach; resolve there with --extra-index-url",
    ),
}


def _pip_report(
    target: Target, requirements: list[str], constraints: Path | None, no_deps: bool
) -> dict:
    """{name: (version, sha256)} that pip would install for the target's platform, names
    normalized (`_` as `-`)."""
    major, minor = target.python.split(".")
    with tempfile.TemporaryDirectory() as tmp:
        args = [] if target.machine_index else ["--isolated"]
        args += ["--only-binary=:all:", "--target", str(Path(tmp) / "t")]
        args += ["--python-version", target.python, "--implementation", "cp"]
        args += ["--abi", f"cp{major}{minor}", *(f"--platform={p}" for p in MANYLINUX)]
        args += ["-c", str(constraints)] if constraints else ["--require-hashes"]
        if target.extra_index:
            args += ["--extra-index-url", target.extra_index]
        resolved = resolve_with_pip(requirements, no_deps, args)
    return {name.replace("_", "-"): pin for name, pin in resolved.items()}


def _requirements(path: Path) -> list[str]:
    """An optional requirements file's lines: none where the target has no such file."""
    return requirement_lines(path) if path.exists() else []


def _dev_constraints(target: Target, out: Path) -> Path:
    """The dev lock's versions (local labels such as +cpu dropped) as a constraints file."""
    lines = []
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split(" ")[0].split("==")
            if name.lower().replace("_", "-") not in target.unconstrained:
                lines.append(f"{name}=={version.split('+')[0]}")
    out.write_text("\n".join(lines) + "\n")
    return out


def resolve(name: str) -> tuple[dict, dict]:
    """Returns the router and engine package sets of target `name`."""
    target = TARGETS[name]
    router_in = _requirements(IMAGES / "requirements-router.in")
    engine_in = [r for r in _requirements(IMAGES / name / "requirements-engine.in")]
    nodeps_in = _requirements(IMAGES / name / "requirements-nodeps.in")
    with tempfile.TemporaryDirectory() as tmp:
        constraints = _dev_constraints(target, Path(tmp) / "constraints.txt")
        everything = _pip_report(target, router_in + engine_in, constraints, no_deps=False)
        pinned = Path(tmp) / "pinned.txt"
        pinned.write_text("".join(f"{n}=={v}\n" for n, (v, _) in everything.items()))
        router = _pip_report(target, router_in, pinned, no_deps=False)
        everything.update(_pip_report(target, nodeps_in, constraints, no_deps=True))
    engine = {n: v for n, v in everything.items() if n not in router}
    return router, engine


def verify(name: str, path: Path) -> dict:
    """Resolves a lock as written (exact files, by hash) for its target's platform; returns what
    pip would install: {name: (version, sha256)}."""
    text = path.read_text().replace("\\\n", "")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return _pip_report(TARGETS[name], lines, None, no_deps=True)


def parse(path: Path) -> dict:
    """{name: (version, sha256)} as a lock file lists them."""
    text = path.read_text().replace("\\\n", "")
    packages = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            requirement, _, sha256 = line.partition(" --hash=sha256:")
            pkg, version = requirement.strip().split("==")
            packages[pkg] = (version, sha256.strip())
    return packages


def render(name: str, packages: dict, layer: str) -> str:
    target = TARGETS[name]
    lines = [
        "# Generated by `python -m tools.oci.lock " + name + "`; do not edit.",
        f"# The {layer} layer of the {name} images: x86_64 Linux, CPython {target.python}.",
    ]
    if target.unresolvable and layer == "engine":
        lines.append(f"# unresolved: {target.unresolvable}")
    return "\n".join([*lines, *lock_lines(packages)]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.oci.lock",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--check", action="store_true", help="fail if a lock would change")
    args = parser.parse_args()
    router, engine = resolve(args.target)
    stale = []
    for layer, packages in (("router", router), ("engine", engine)):
        path = IMAGES / args.target / f"{layer}.lock"
        text = render(args.target, packages, layer)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"lock: {len(packages)} packages in {path.relative_to(ROOT)}")
    if stale:
        sys.exit(f"lock: out of date: {', '.join(stale)}; run python -m tools.oci.lock")


if __name__ == "__main__":
    main()
