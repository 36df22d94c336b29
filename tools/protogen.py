"""Generates Python protobuf + gRPC modules with grpcio-tools (one protoc, shared by Bazel and
tools/devicepack.py so the two can never differ).

Paths are relative to the repo root, so proto/tandem/v1/decode.proto becomes the module
proto.tandem.v1.decode_pb2 (and decode_pb2_grpc).

Usage: python -m tools.protogen OUT_DIR PROTO...
"""

from __future__ import annotations

import sys
from importlib import resources

from grpc_tools import protoc


def generate(protos: list[str], out_dir: str, proto_root: str = ".") -> None:
    """Writes <out_dir>/<proto path>_pb2.py, _pb2.pyi and _pb2_grpc.py for each proto."""
    well_known = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--proto_path={well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protogen: protoc failed for {' '.join(protos)}")


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m tools.protogen OUT_DIR PROTO...")
    generate(sys.argv[2:], sys.argv[1])


if __name__ == "__main__":
    main()
