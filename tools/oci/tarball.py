"""Deterministic layer tarballs: the same inputs give the same bytes, whatever the machine.

Every layer tandem writes is a plain (uncompressed) POSIX tar whose entries are sorted by path,
with every parent directory present, and with no user or group names. Files tandem adds are
owned by 0:0 with mtime 0; a root filesystem made by another tool (mmdebstrap) keeps its owners,
modes and mtimes and only gets the same sorting and header normalization.

NOTE: layers stay uncompressed: gzip output depends on the zlib build, so a compressed layer's
digest could differ between two machines. Registries get compressed layers anyway: `skopeo copy`
to a registry compresses them on the way.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One tar member, by its path inside the layer ("usr/bin/python3", no leading slash)."""

    name: str
    type: bytes
    """tarfile's type byte: REGTYPE, DIRTYPE, SYMTYPE, LNKTYPE, CHRTYPE, BLKTYPE, FIFOTYPE."""
    mode: int
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    linkname: str = ""
    """Target of a symlink, or the member path a hard link points at."""
    source: str | None = None
    """File whose bytes a regular entry holds."""
    data: bytes | None = None
    """Or: the bytes themselves."""
    tar_source: tuple[tarfile.TarFile, tarfile.TarInfo] | None = None
    """Or: the member of an open tar whose bytes it holds."""
    devmajor: int = 0
    devminor: int = 0


def normalize_name(name: str) -> str:
    name = os.path.normpath(name.lstrip("/")).lstrip("/")
    if name.startswith("./"):
        name = name[2:]
    return "" if name == "." else name


def file_entries(files: dict[str, str]) -> list[Entry]:
    """Entries for {path in layer: file on disk}, owned by 0:0, mtime 0, modes 0644 or 0755."""
    entries = []
    for dest, src in files.items():
        executable = os.stat(src).st_mode & 0o111
        entries.append(
            Entry(normalize_name(dest), tarfile.REGTYPE, 0o755 if executable else 0o644, source=src)
        )
    return entries


def tree_entries(root: Path, prefix: str) -> list[Entry]:
    """Entries for everything under `root`, placed under `prefix`, owned by 0:0, mtime 0."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            dest = normalize_name(f"{prefix}/{path.relative_to(root)}")
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                entries.append(Entry(dest, tarfile.SYMTYPE, 0o777, linkname=os.readlink(path)))
            elif stat.S_ISDIR(st.st_mode):
                entries.append(Entry(dest, tarfile.DIRTYPE, 0o755))
            elif stat.S_ISREG(st.st_mode):
                mode = 0o755 if st.st_mode & 0o111 else 0o644
                entries.append(Entry(dest, tarfile.REGTYPE, mode, source=str(path)))
            else:
                raise ValueError(f"{path}: not a file, directory or symlink")
    return entries


def rootfs_entries(archive: tarfile.TarFile) -> list[Entry]:
    """The members of a root filesystem tar as entries, keeping owners, modes and mtimes."""
    entries = []
    for info in archive.getmembers():
        name = normalize_name(info.name)
        if not name:
            continue
        linkname = normalize_name(info.linkname) if info.islnk() else info.linkname
        entries.append(
            Entry(
                name,
                info.type,
                info.mode,
                info.uid,
                info.gid,
                int(info.mtime),
                linkname,
                tar_source=(archive, info) if info.isreg() else None,
                devmajor=info.devmajor,
                devminor=info.devminor,
            )
        )
    return entries


def _with_parents(entries: Iterable[Entry]) -> list[Entry]:
    by_name = {}
    for entry in entries:
        if entry.name in by_name and by_name[entry.name] != entry:
            raise ValueError(f"{entry.name}: given twice, differently")
        by_name[entry.name] = entry
    for name in list(by_name):
        parent = os.path.dirname(name)
        while parent and parent not in by_name:
            by_name[parent] = Entry(parent, tarfile.DIRTYPE, 0o755)
            parent = os.path.dirname(parent)
    return sorted(by_name.values(), key=lambda e: e.name)


def _hard_links_first(entries: list[Entry]) -> list[Entry]:
    """Sorting can put a hard link before the file it names; the first of each group then becomes
    the file, and the others link to it."""
    out = []
    first_of_group: dict[str, str] = {}  # the original file's name -> the name now holding data
    originals = {e.name: e for e in entries}
    for entry in entries:
        if entry.type != tarfile.LNKTYPE:
            if entry.name in first_of_group:  # its bytes were already written under another name
                entry = Entry(entry.name, tarfile.LNKTYPE, entry.mode, entry.uid, entry.gid,
                              entry.mtime, first_of_group[entry.name])  # fmt: skip
            else:
                first_of_group[entry.name] = entry.name
            out.append(entry)
            continue
        target = entry.linkname
        if target not in first_of_group:
            original = originals[target]
            entry = Entry(entry.name, original.type, original.mode, original.uid, original.gid,
                          original.mtime, source=original.source, data=original.data,
                          tar_source=original.tar_source)  # fmt: skip
            first_of_group[target] = entry.name
        else:
            entry = Entry(entry.name, tarfile.LNKTYPE, entry.mode, entry.uid, entry.gid,
                          entry.mtime, first_of_group[target])  # fmt: skip
        out.append(entry)
    return out


class _HashingWriter:
    def __init__(self, out) -> None:
        self.out = out
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.out.write(data)


def write_tar(entries: Iterable[Entry], out_path: Path) -> tuple[str, int]:
    """Writes the entries (plus missing parent directories), sorted; returns (sha256 hex, size)."""
    with open(out_path, "wb") as out:
        writer = _HashingWriter(out)
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for entry in _hard_links_first(_with_parents(entries)):
                info = tarfile.TarInfo(entry.name)
                info.type, info.mode = entry.type, entry.mode
                info.uid, info.gid, info.mtime = entry.uid, entry.gid, entry.mtime
                info.uname = info.gname = ""
                info.linkname = entry.linkname
                info.devmajor, info.devminor = entry.devmajor, entry.devminor
                if entry.type == tarfile.REGTYPE:
                    with _open_source(entry) as data:
                        info.size = _size(entry)
                        tar.addfile(info, data)
                else:
                    tar.addfile(info)
    return writer.sha256.hexdigest(), writer.size


def _size(entry: Entry) -> int:
    if entry.data is not None:
        return len(entry.data)
    if entry.tar_source is not None:
        return entry.tar_source[1].size
    return os.stat(entry.source).st_size


def _open_source(entry: Entry):
    if entry.data is not None:
        return io.BytesIO(entry.data)
    if entry.tar_source is not None:
        archive, info = entry.tar_source
        return archive.extractfile(info)
    return open(entry.source, "rb")


def sha256_file(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
