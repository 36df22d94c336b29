"""The cuda and rocm images, built on a stand-in for their pinned base: the base's layers come
first, byte for byte (gzip-compressed, as pulled); then the target's router packages, the engine
packages (prefill, decode) and the service's code, the same code layer as the CPU image's; the
config keeps the base's environment and labels and adds the service's."""

from __future__ import annotations

import pytest

from images.tests.archive import file_sha256, read

SERVICES = {"router": "8000/tcp", "prefill": "8100/tcp", "decode": "50051/tcp"}
CASES = [(s, t) for t in ("cuda", "rocm") for s in SERVICES]


@pytest.fixture(scope="module")
def base():
    return read("images/standin_base.tar")


@pytest.mark.parametrize(("service", "target"), CASES)
def test_layers(base, service, target):
    image = read(f"images/{service}_{target}_standin.tar")
    layers = image.manifest["layers"]
    assert layers[0] == base.manifest["layers"][0]
    assert layers[0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert image.blobs[layers[0]["digest"]] == base.blobs[layers[0]["digest"]]
    ours = [layer["digest"] for layer in layers[1:]]
    expected = [file_sha256(f"images/{target}_router_deps.tar")]
    if service != "router":
        expected.append(file_sha256("images/standin_engine_deps.tar"))
    expected.append(read(f"images/{service}_cpu.tar").manifest["layers"][-1]["digest"])
    assert ours == expected
    for layer in layers:  # every blob is stored under its own digest
        assert image.blob_sha256[layer["digest"]] == layer["digest"]
    diff_ids = image.config["rootfs"]["diff_ids"]
    assert diff_ids[0] == base.config["rootfs"]["diff_ids"][0]
    assert diff_ids[1:] == ours  # uncompressed: digest == diff id
    assert len(image.config["history"]) == len(diff_ids)
    annotations = image.manifest["annotations"]
    assert (
        annotations["org.opencontainers.image.base.digest"] == base.index["manifests"][0]["digest"]
    )


@pytest.mark.parametrize(("service", "target"), CASES)
def test_config(service, target):
    image = read(f"images/{service}_{target}_standin.tar")
    config = image.config["config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"  # the base's
    assert env["PYTHON_VERSION"] == "3.12.0"
    assert env["PYTHONPATH"] == "/opt/tandem/app:/opt/tandem/python"
    assert env["PYTHONPYCACHEPREFIX"] == "/tmp/pycache"
    assert ("NVIDIA_VISIBLE_DEVICES" in env) == (target == "cuda")
    assert config["Entrypoint"] == ["python3", "-m", f"{service}.server"]
    assert "Cmd" not in config
    assert config["User"] == "1000:1000"
    assert config["ExposedPorts"] == {SERVICES[service]: {}}
    assert config["Labels"] == {
        "standin": "base",
        "org.opencontainers.image.title": f"tandem-{service}",
        "org.opencontainers.image.description": f"tandem {service} ({target})",
        "dev.tandem.service": service,
        "dev.tandem.target": target,
    }
    assert (image.config["architecture"], image.config["os"]) == ("amd64", "linux")
    assert image.config["created"] == "1970-01-01T00:00:00Z"
