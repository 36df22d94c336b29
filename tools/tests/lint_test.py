"""Lint and format checks over the whole source tree: ruff for Python, buildifier for Bazel files.

NOTE: this test reads the real source tree (found through its WORKSPACE runfile), not just its
declared inputs, so that a new package can never escape the checks; it is tagged "external" so
Bazel never serves it from cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.path.realpath("WORKSPACE")).parent
BIN = Path(sys.executable).parent  # the venv's bin: ruff and buildifier are installed there
# Checks that need rules_python / rules_cc, which cannot be fetched offline.
BUILDIFIER_DISABLED = [
    "native-py",
    "native-cc-library",
    "native-cc-binary",
    "native-cc-test",
    "native-cc-toolchain",
    "native-cc-toolchain-suite",
]


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd[:3])} failed:\n{result.stdout}{result.stderr}"


def _bazel_files() -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "bazel-"))]
        for name in filenames:
            if name in ("BUILD.bazel", "WORKSPACE") or name.endswith(".bzl"):
                found.append(os.path.relpath(os.path.join(dirpath, name), ROOT))
    return sorted(found)


def test_source_tree_found():
    assert (ROOT / "bazelw").is_file(), ROOT


def test_ruff_check():
    _run([str(BIN / "ruff"), "check", "--no-cache", "."])


def test_ruff_format():
    _run([str(BIN / "ruff"), "format", "--check", "--no-cache", "."])


def test_buildifier():
    files = _bazel_files()
    assert "WORKSPACE" in files and "tools/bazel/proto.bzl" in files
    warnings = "-" + ",-".join(BUILDIFIER_DISABLED)
    _run([str(BIN / "buildifier"), "-mode=check", "-lint=warn", f"-warnings={warnings}", *files])
