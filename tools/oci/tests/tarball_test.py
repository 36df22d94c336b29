"""Layer tarballs are a function of their content alone: not of file mtimes, owners or the order
files were found in; parents are present; hard links always follow the file they name."""

from __future__ import annotations

import os
import tarfile

from tools.oci import tarball


def _tree(root, mtime):
    (root / "pkg/sub").mkdir(parents=True)
    (root / "pkg/a.py").write_text("a = 1\n")
    (root / "pkg/sub/run.sh").write_text("#!/bin/sh\n")
    (root / "pkg/sub/run.sh").chmod(0o700)
    os.symlink("a.py", root / "pkg/link.py")
    for path in [*root.rglob("*"), root]:
        os.utime(path, (mtime, mtime), follow_symlinks=False)


def test_same_content_same_bytes(tmp_path):
    digests = []
    for i, mtime in enumerate([1_000_000, 2_000_000]):
        root = tmp_path / f"t{i}"
        _tree(root, mtime)
        out = tmp_path / f"layer{i}.tar"
        digests.append(tarball.write_tar(tarball.tree_entries(root, "opt/x"), out))
    assert digests[0] == digests[1]
    with tarfile.open(tmp_path / "layer0.tar") as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert names[:3] == ["opt", "opt/x", "opt/x/pkg"]
    assert all((m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "") for m in members)
    modes = {m.name: m.mode for m in members}
    assert modes["opt/x/pkg/a.py"] == 0o644 and modes["opt/x/pkg/sub/run.sh"] == 0o755
    link = next(m for m in members if m.name == "opt/x/pkg/link.py")
    assert link.issym() and link.linkname == "a.py"


def test_rootfs_keeps_owners_and_reorders_hard_links(tmp_path):
    data = tmp_path / "data"
    data.write_bytes(b"payload")
    src = tmp_path / "rootfs.tar"
    with tarfile.open(src, "w") as tar:
        info = tarfile.TarInfo("./usr/z-original")
        info.size, info.uid, info.gid, info.mtime, info.mode = 7, 0, 42, 1234, 0o640
        tar.addfile(info, data.open("rb"))
        link = tarfile.TarInfo("./usr/a-link")
        link.type, link.linkname = tarfile.LNKTYPE, "./usr/z-original"
        tar.addfile(link)
    out = tmp_path / "layer.tar"
    with tarfile.open(src) as archive:
        tarball.write_tar(tarball.rootfs_entries(archive), out)
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert list(members) == ["usr", "usr/a-link", "usr/z-original"]
        first = members["usr/a-link"]
        assert first.isreg() and tar.extractfile(first).read() == b"payload"
        assert (first.gid, first.mode, first.mtime) == (42, 0o640, 1234)
        second = members["usr/z-original"]
        assert second.islnk() and second.linkname == "usr/a-link"
