"""Two clean builds give the same CPU images: this test builds them again with Bazel in a fresh
output base (every package fetched and installed anew, every layer rewritten) and compares the
manifest digests with those of the build it is part of."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(os.path.realpath("WORKSPACE")).parent
IMAGES = ["cpu_base", "router_cpu", "prefill_cpu", "decode_cpu"]


@pytest.fixture()
def output_base():
    """A fresh output base, removed afterwards with the nested build's caches (~5 GB that would
    stay in Bazel's per-test folder: this test runs unsandboxed)."""
    scratch = Path(os.environ["TEST_TMPDIR"])
    yield scratch / "clean"
    for made in (scratch / "clean", scratch / "_bazel_root"):
        if made.exists():
            subprocess.run(["chmod", "-R", "u+w", str(made)], check=False)  # read-only outputs
            shutil.rmtree(made, ignore_errors=True)


def test_clean_build_gives_the_same_digests(output_base):
    targets = [f"//images:{name}" for name in IMAGES]
    # --symlink_prefix=/: no bazel-* links, which would repoint the workspace's at this build.
    cmd = ["bazel", f"--output_base={output_base}", "--batch", "build", "--symlink_prefix=/"]
    cmd += ["--output_groups=default,digest", *targets]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-5000:]
    bin_dir = output_base / "execroot/tandem/bazel-out/k8-fastbuild/bin/images"
    for name in IMAGES:
        first = Path(f"images/{name}.digest").read_text()
        assert (bin_dir / f"{name}.digest").read_text() == first, name
