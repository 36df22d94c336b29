"""Each target's Python locks resolve, as written (exact versions and file hashes), for that
target's platform and CPython; the ROCm engine lock says what it lacks, and its layer refuses to
build from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.oci import lock

LOCKS = [(t, layer) for t in ("cpu", "cuda", "rocm") for layer in ("router", "engine")]


@pytest.mark.parametrize(("target", "layer"), LOCKS)
def test_lock_resolves_for_its_platform(target, layer):
    path = Path(f"images/{target}/{layer}.lock")
    listed = lock.parse(path)
    assert lock.verify(target, path) == listed
    if layer == "router":
        assert {"transformers", "fastapi", "grpcio", "jinja2"} <= set(listed)
        assert "torch" not in listed


def test_cuda_engine_lock_is_the_cuda_torch_build():
    listed = lock.parse(Path("images/cuda/engine.lock"))
    assert listed["torch"][0] == "2.13.0"  # PyPI's build: CUDA 13
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton", "nixl-cu13"} <= set(listed)


def test_cpu_engine_lock_is_the_cpu_torch_build():
    listed = lock.parse(Path("images/cpu/engine.lock"))
    assert listed["torch"][0] == "2.13.0+cpu"
    assert not any(name.startswith("nvidia-") for name in listed)


def test_rocm_engine_lock_names_what_is_missing_and_its_layer_refuses_to_build(tmp_path):
    path = Path("images/rocm/engine.lock")
    assert "# unresolved: torch==2.13.0 (ROCm build)" in path.read_text()
    build = [sys.executable, "-m", "tools.oci.build", "pip-layer", "--lock", str(path)]
    build += ["--python", "3.12", "--prefix", "/opt", "--out", str(tmp_path / "layer.tar")]
    result = subprocess.run(build, capture_output=True, text=True)
    assert result.returncode != 0
    assert "is incomplete; unresolved: torch==2.13.0" in result.stderr
