"""Reading what an oci-archive holds, for the images' tests."""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Archive:
    index: dict
    manifest: dict
    config: dict
    blobs: dict[str, bytes]
    """Small blobs (< 1 MiB) by digest; larger ones by their sha256 only."""
    blob_sha256: dict[str, str]
    """Every blob's actual sha256, by the digest it is stored under."""


def read(path: str | Path) -> Archive:
    blobs, hashes = {}, {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith("blobs/"):
                continue
            digest = "sha256:" + member.name.rsplit("/", 1)[1]
            data = tar.extractfile(member)
            sha = hashlib.sha256()
            for chunk in iter(lambda d=data: d.read(1 << 20), b""):
                sha.update(chunk)
                if member.size < 1 << 20:
                    blobs[digest] = blobs.get(digest, b"") + chunk
            hashes[digest] = "sha256:" + sha.hexdigest()
        index = json.load(tar.extractfile("index.json"))
    manifest = json.loads(blobs[index["manifests"][0]["digest"]])
    config = json.loads(blobs[manifest["config"]["digest"]])
    return Archive(index, manifest, config, blobs, hashes)


def file_sha256(path: str | Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return "sha256:" + sha.hexdigest()
