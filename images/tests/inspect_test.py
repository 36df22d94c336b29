"""skopeo and umoci accept every image built here: skopeo reads its manifest and config, umoci
unpacks it (checking each layer against its digest and diff id) into a runtime bundle."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

IMAGES = ["cpu_base"] + [f"{s}_cpu" for s in ("router", "prefill", "decode")]
IMAGES += [f"{s}_{t}_standin" for t in ("cuda", "rocm") for s in ("router", "prefill", "decode")]


def _run(*cmd: str) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"{cmd[0]} {cmd[1]} failed: {result.stderr[-2000:]}"
    return result.stdout


@pytest.mark.parametrize("name", IMAGES)
def test_skopeo_inspect(name):
    archive = f"oci-archive:images/{name}.tar"
    digest = Path(f"images/{name}.digest").read_text().strip()
    assert json.loads(_run("skopeo", "inspect", archive))["Digest"] == digest
    config = json.loads(_run("skopeo", "inspect", "--config", archive))
    assert config["rootfs"]["diff_ids"]


@pytest.fixture()
def scratch(tmp_path):
    """tmp_path, emptied after the test: the unpacked images add up to ~10 GB."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("name", IMAGES)
def test_umoci_unpack(name, scratch):
    layout = scratch / "layout"
    with tarfile.open(f"images/{name}.tar") as tar:
        tar.extractall(layout)
    stat = json.loads(_run("umoci", "stat", "--json", "--image", f"{layout}:{name}"))
    assert stat["history"]
    bundle = scratch / "bundle"
    _run("umoci", "unpack", "--image", f"{layout}:{name}", str(bundle))
    spec = json.loads((bundle / "config.json").read_text())
    if name != "cpu_base":
        assert spec["process"]["args"][:2] == ["python3", "-m"]
        assert (spec["process"]["user"]["uid"], spec["process"]["user"]["gid"]) == (1000, 1000)
        assert (bundle / "rootfs/opt/tandem/app").is_dir()
    if "standin" not in name:
        assert (bundle / "rootfs/usr/bin/python3.11").is_file()
