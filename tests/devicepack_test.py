"""The Bazel-free path used on the GPU machine: tools/devicepack generates the tandem.v1 modules
into a folder, and the decode service's gRPC suite passes importing them from there (not from
Bazel)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools import devicepack


def test_generated_modules_serve_the_round_trip_suite(tmp_path):
    out = tmp_path / "devicepack"
    generated = devicepack.build(out)
    names = sorted(p.relative_to(out).as_posix() for p in generated)
    assert names == [
        "proto/tandem/v1/decode_pb2.py",
        "proto/tandem/v1/decode_pb2_grpc.py",
        "proto/tandem/v1/layout_pb2.py",
        "proto/tandem/v1/layout_pb2_grpc.py",
    ]
    # NOTE: Bazel's own generated modules are in the runfiles too (the suite's deps bring them):
    # with no script folder or cwd put first on the path (PYTHONSAFEPATH) and pytest leaving
    # sys.path alone (importlib mode), `out`, first on PYTHONPATH, is where proto/ resolves.
    env = {
        **os.environ,
        "PYTHONPATH": f"{out}{os.pathsep}{devicepack.ROOT}",
        "PYTHONSAFEPATH": "1",
    }
    check = "import proto.tandem.v1.decode_pb2 as m; print(m.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, check=True
    )
    assert Path(where.stdout.strip()).is_relative_to(out)  # not a Bazel-generated copy
    suite = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            "decode/tests/service_test.py",
        ],
        cwd=devicepack.ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert suite.returncode == 0, suite.stdout + suite.stderr
    assert " passed" in suite.stdout
