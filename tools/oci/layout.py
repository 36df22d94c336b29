"""OCI images as tandem writes them: an oci-archive (a tar of an OCI image layout) holding one
image manifest, its config and its layers, all JSON serialized with sorted keys.

A base image comes in as an oci-archive too. Its layer blobs are copied byte for byte, with their
digests and media types, so a registry already holding the base never receives them again.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tools.oci.tarball import Entry, sha256_file, write_tar

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"
# Docker's media types, as a base pulled from Docker Hub may still carry; same bytes.
_DOCKER_TO_OCI = {
    "application/vnd.docker.distribution.manifest.v2+json": MANIFEST,
    "application/vnd.docker.container.image.v1+json": CONFIG,
    "application/vnd.docker.image.rootfs.diff.tar.gzip": LAYER + "+gzip",
    "application/vnd.docker.image.rootfs.diff.tar": LAYER,
}
EPOCH = "1970-01-01T00:00:00Z"


def dumps(obj: object) -> bytes:
    """Canonical JSON: the digest of a manifest or config depends on nothing but its content."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Blob:
    """One content-addressed blob: a descriptor and where its bytes are."""

    media_type: str
    digest: str
    """"sha256:<hex>"."""
    size: int
    data: bytes | None = None
    path: Path | None = None
    member: tuple[tarfile.TarFile, tarfile.TarInfo] | None = None

    def descriptor(self) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


def json_blob(media_type: str, obj: object) -> Blob:
    data = dumps(obj)
    return Blob(media_type, "sha256:" + hashlib.sha256(data).hexdigest(), len(data), data=data)


def file_blob(media_type: str, path: Path) -> Blob:
    digest, size = sha256_file(path)
    return Blob(media_type, "sha256:" + digest, size, path=path)


@dataclass(frozen=True)
class Image:
    """An image read from an oci-archive: its config (parsed) and its layer blobs, in order."""

    config: dict
    layers: tuple[Blob, ...]
    manifest_digest: str


def read_archive(path: Path) -> Image:
    """Reads the one linux/amd64 image of an oci-archive (an index may list several platforms).

    NOTE: the returned blobs read from the open archive: keep using them before it is collected.
    """
    archive = tarfile.open(path)  # noqa: SIM115 (the blobs read from it later)
    members = {m.name.removeprefix("./"): m for m in archive.getmembers()}

    def read(name: str) -> bytes:
        return archive.extractfile(members[name]).read()

    def blob_member(digest: str) -> tarfile.TarInfo:
        return members["blobs/" + digest.replace(":", "/")]

    index = json.loads(read("index.json"))
    manifest = _amd64_manifest(index, lambda d: json.loads(read("blobs/" + d.replace(":", "/"))))
    config = json.loads(read("blobs/" + manifest["config"]["digest"].replace(":", "/")))
    layers = tuple(
        Blob(
            _DOCKER_TO_OCI.get(layer["mediaType"], layer["mediaType"]),
            layer["digest"],
            layer["size"],
            member=(archive, blob_member(layer["digest"])),
        )
        for layer in manifest["layers"]
    )
    return Image(config, layers, manifest["_digest"])


def _amd64_manifest(index: dict, load) -> dict:
    for descriptor in index["manifests"]:
        media_type = _DOCKER_TO_OCI.get(descriptor["mediaType"], descriptor["mediaType"])
        platform = descriptor.get("platform", {"os": "linux", "architecture": "amd64"})
        if (platform["os"], platform["architecture"]) != ("linux", "amd64"):
            continue
        doc = load(descriptor["digest"])
        if media_type == MANIFEST:
            return {**doc, "_digest": descriptor["digest"]}
        if media_type in (INDEX, "application/vnd.docker.distribution.manifest.list.v2+json"):
            return _amd64_manifest(doc, load)
    raise ValueError("the archive holds no linux/amd64 image manifest")


@dataclass(frozen=True)
class ConfigSpec:
    """What an image sets on top of its base's config."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    """Added to the base's environment; a name the base sets is overridden."""
    user: str
    workdir: str
    exposed_ports: list[str]
    """"8000/tcp"."""
    labels: dict[str, str]
    layer_comments: list[str]
    """One history comment per added layer."""


def image_config(base: dict, diff_ids: list[str], spec: ConfigSpec) -> dict:
    """The new image's config: the base's, with the spec applied and the new layers appended."""
    base_config = base.get("config") or {}
    env = dict(item.split("=", 1) for item in base_config.get("Env") or [])
    env.update(spec.env)
    config = {
        "Env": [f"{k}={v}" for k, v in env.items()],
        "Entrypoint": spec.entrypoint,
        "Cmd": spec.cmd,
        "User": spec.user,
        "WorkingDir": spec.workdir,
        "ExposedPorts": {p: {} for p in spec.exposed_ports},
        "Labels": {**(base_config.get("Labels") or {}), **spec.labels},
    }
    history = list(base.get("history") or [])
    history += [{"created": EPOCH, "created_by": c} for c in spec.layer_comments]
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": EPOCH,
        "config": {k: v for k, v in config.items() if v},
        "rootfs": {"type": "layers", "diff_ids": [*base["rootfs"]["diff_ids"], *diff_ids]},
        "history": history,
    }


def write_archive(
    out: Path, config: Blob, layers: list[Blob], ref_name: str, annotations: dict[str, str]
) -> str:
    """Writes an oci-archive of one image; returns the manifest's digest."""
    manifest = json_blob(
        MANIFEST,
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": config.descriptor(),
            "layers": [layer.descriptor() for layer in layers],
            "annotations": annotations,
        },
    )
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [
            {
                **manifest.descriptor(),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"org.opencontainers.image.ref.name": ref_name},
            }
        ],
    }
    entries = [
        _bytes_entry("oci-layout", dumps({"imageLayoutVersion": "1.0.0"})),
        _bytes_entry("index.json", dumps(index)),
    ]
    seen = set()
    for blob in [manifest, config, *layers]:
        if blob.digest in seen:  # two equal layers: one blob
            continue
        seen.add(blob.digest)
        entries.append(_blob_entry(blob))
    write_tar(entries, out)
    return manifest.digest


def _bytes_entry(name: str, data: bytes) -> Entry:
    return Entry(name, tarfile.REGTYPE, 0o644, data=data)


def _blob_entry(blob: Blob) -> Entry:
    name = "blobs/" + blob.digest.replace(":", "/")
    if blob.data is not None:
        return _bytes_entry(name, blob.data)
    if blob.path is not None:
        return Entry(name, tarfile.REGTYPE, 0o644, source=str(blob.path))
    return Entry(name, tarfile.REGTYPE, 0o644, tar_source=blob.member)
