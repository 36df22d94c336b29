"""Generates what tandem needs to run without Bazel (the GPU machine has no Bazel and no package
registry): the tandem.v1 protobuf/gRPC modules, written under an ignored folder to carry along.

    python -m tools.devicepack [--out .devicepack]
    # on the other machine, from the repo root:
    PYTHONPATH=.devicepack:. python3 -m decode.server ...

`proto/` and its subfolders are namespace packages (no __init__.py), so the generated modules in
.devicepack/proto/tandem/v1/ and the sources in proto/ form one `proto.tandem.v1` package.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from tools.protogen import generate

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = "proto/tandem/v1"


def build(out: Path) -> list[Path]:
    """Regenerates `out` from scratch; returns the generated modules."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    protos = sorted(str(p) for p in (ROOT / PROTO_DIR).glob("*.proto"))
    generate(protos, str(out), proto_root=str(ROOT))
    return sorted(out.rglob("*.py"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".devicepack", help="output folder")
    args = parser.parse_args()
    for path in build(args.out.resolve()):
        print(path)


if __name__ == "__main__":
    main()
