"""The steps that build tandem's images, one subcommand each (run by the rules in
tools/bazel/oci.bzl; every output is a deterministic function of the inputs):

    rootfs      Debian root filesystem layer from a pinned package list (mmdebstrap)
    files-layer layer from {path in image: file} (an app's runfiles)
    pip-layer   layer of Python packages installed from a lock file (--no-deps, hashes required)
    image       oci-archive: a base image (or none) + layers + config

python -m tools.oci.build SUBCOMMAND --help for the arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tools.oci import tarball
from tools.oci.layout import (
    CONFIG,
    LAYER,
    ConfigSpec,
    file_blob,
    image_config,
    json_blob,
    read_archive,
    write_archive,
)

# The suite itself only, not {suite}-updates or {suite}-security: those change every week and
# the mirror drops the versions they replace, while the versions the suite references stay in the
# pool until its next point release, so a pinned list keeps building until then. Security updates
# arrive by re-pinning deliberately: python -m tools.oci.pin_debian images/cpu/packages.lock
DEBIAN_MIRRORS = [
    "deb http://deb.debian.org/debian {suite} main",
]
# Left out of the root filesystem: documentation and translations (copyright files stay).
DPKG_EXCLUDES = [
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
]
MANYLINUX = ["linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
MANYLINUX += [f"manylinux_2_{minor}_x86_64" for minor in range(5, 29)]


def read_package_lock(path: Path) -> tuple[dict[str, str], list[str], str, int]:
    """Returns ({package: version}, top-level packages, suite, SOURCE_DATE_EPOCH)."""
    pins, fields = {}, {}
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            fields[key.strip()] = value.strip()
        elif line.strip():
            name, version = line.strip().split("=", 1)
            pins[name] = version
    return pins, fields["include"].split(), fields["suite"], int(fields["source-date-epoch"])


def run_mmdebstrap(
    include: list[str], suite: str, epoch: int, out: Path, packages_out: Path
) -> None:
    """Debian `suite` with the essential set + `include`, as a tar; its package list to a file."""
    hooks = [
        # Debian compiles the stdlib at install time with timestamp-checked .pyc files; every
        # mtime becomes SOURCE_DATE_EPOCH in the tar, which would make them all stale. Hash-based
        # .pyc files stay valid whatever the mtimes (PYTHONHASHSEED=0: set constants in order).
        'chroot "$1" env PYTHONHASHSEED=0 python3 -m compileall -q -f -j 1'
        " --invalidation-mode unchecked-hash /usr/lib/python3",
        f'chroot "$1" dpkg-query -W -f="\\${{Package}}=\\${{Version}}\\n" > {packages_out}',
    ]
    cmd = ["mmdebstrap", "--quiet", "--mode=root", "--variant=essential", "--format=tar"]
    cmd += ["--skip=output/dev", "--include=" + ",".join(include)]
    cmd += [f"--dpkgopt={opt}" for opt in DPKG_EXCLUDES]
    cmd += [f"--customize-hook={hook}" for hook in hooks]
    cmd += [suite, str(out), *(m.format(suite=suite) for m in DEBIAN_MIRRORS)]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch)}
    subprocess.run(cmd, check=True, env=env, stdin=subprocess.DEVNULL)


def cmd_rootfs(args: argparse.Namespace) -> None:
    pins, include, suite, epoch = read_package_lock(args.packages)
    with tempfile.TemporaryDirectory() as tmp:
        raw, listed = Path(tmp) / "rootfs.tar", Path(tmp) / "packages.txt"
        run_mmdebstrap(include, suite, epoch, raw, listed)
        got = dict(line.split("=", 1) for line in listed.read_text().split())
        if got != pins:
            changed = sorted(
                f"{name}: pinned {pins.get(name, '-')}, mirror gave {got.get(name, '-')}"
                for name in set(pins) | set(got)
                if pins.get(name) != got.get(name)
            )
            sys.exit(
                f"rootfs: the Debian mirror no longer serves the package set pinned in "
                f"{args.packages}:\n  " + "\n  ".join(changed) + "\nRe-pin it (then commit "
                f"the file): python -m tools.oci.pin_debian {args.packages}"
            )
        with tarfile.open(raw) as archive:
            tarball.write_tar(tarball.rootfs_entries(archive), args.out)


def cmd_files_layer(args: argparse.Namespace) -> None:
    files = json.loads(args.files.read_text())
    tarball.write_tar(tarball.file_entries(files), args.out)


def cmd_pip_layer(args: argparse.Namespace) -> None:
    for line in args.lock.read_text().splitlines():
        if line.startswith("# unresolved:"):
            sys.exit(f"pip-layer: {args.lock} is incomplete; {line[2:]}")
    major, minor = args.python.split(".")
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "site"
        cmd = [sys.executable, "-m", "pip", "install", "-qq", "--no-deps", "--require-hashes"]
        cmd += ["--no-compile", "--only-binary=:all:", "--target", str(target)]
        cmd += ["--python-version", args.python, "--implementation", "cp"]
        cmd += ["--abi", f"cp{major}{minor}", *(f"--platform={p}" for p in MANYLINUX)]
        cmd += ["-r", str(args.lock)]
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
        # Console scripts name the build machine's interpreter: the services never use them.
        subprocess.run(["rm", "-rf", str(target / "bin")], check=True)
        if args.compile:
            _compile(target, args.python, args.prefix)
        tarball.write_tar(tarball.tree_entries(target, args.prefix), args.out)


def _compile(tree: Path, version: str, prefix: str) -> None:
    """Unchecked-hash .pyc files: valid with mtime 0, and the same bytes on every build (the
    source paths they record are the image's, not this build's temporary directory)."""
    running = "{}.{}".format(*sys.version_info[:2])
    if running != version:
        sys.exit(f"pip-layer: --compile needs Python {version} to run this step, not {running}")
    cmd = [sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode"]
    cmd += ["unchecked-hash", "-s", str(tree), "-p", prefix, str(tree)]
    # Bytecode of a few modules in third-party sdists fails to compile (Python 2 leftovers):
    # compileall then exits 1 but has compiled the rest, which is all that is wanted here.
    subprocess.run(cmd, env={**os.environ, "PYTHONHASHSEED": "0"}, stdout=subprocess.DEVNULL)


def cmd_image(args: argparse.Namespace) -> None:
    spec_fields = json.loads(args.spec.read_text())
    spec = ConfigSpec(**spec_fields)
    if len(spec.layer_comments) != len(args.layer):
        sys.exit("image: give one layer comment per --layer")
    if args.base:
        base = read_archive(args.base)
        base_config, base_layers = base.config, list(base.layers)
        annotations = {"org.opencontainers.image.base.digest": base.manifest_digest}
        if args.base_name:
            annotations["org.opencontainers.image.base.name"] = args.base_name
    else:
        base_config, base_layers, annotations = {"rootfs": {"diff_ids": []}}, [], {}
    layers = [file_blob(LAYER, path) for path in args.layer]
    config = json_blob(CONFIG, image_config(base_config, [b.digest for b in layers], spec))
    digest = write_archive(args.out, config, base_layers + layers, args.ref, annotations)
    if args.digest_out:
        args.digest_out.write_text(digest + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.oci.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(required=True)

    p = sub.add_parser("rootfs", help="Debian root filesystem layer (mmdebstrap, as root)")
    p.add_argument("--packages", type=Path, required=True, help="pinned package list")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(run=cmd_rootfs)

    p = sub.add_parser("files-layer", help="layer from a JSON {path in image: file}")
    p.add_argument("--files", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(run=cmd_files_layer)

    p = sub.add_parser("pip-layer", help="layer of the packages of a hashed lock file")
    p.add_argument("--lock", type=Path, required=True)
    p.add_argument("--python", required=True, help="the image's Python, e.g. 3.11")
    p.add_argument("--prefix", required=True, help="where the packages go in the image")
    p.add_argument("--compile", action="store_true", help="add .pyc files (needs that Python)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(run=cmd_pip_layer)

    p = sub.add_parser("image", help="oci-archive of a base + layers + config")
    p.add_argument("--base", type=Path, help="base oci-archive; none: start from scratch")
    p.add_argument("--base-name", default="", help="the base's reference, as an annotation")
    p.add_argument("--layer", type=Path, action="append", default=[])
    p.add_argument("--spec", type=Path, required=True, help="JSON of layout.ConfigSpec")
    p.add_argument("--ref", required=True, help="the archive's reference name")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--digest-out", type=Path, help="file to write the manifest digest to")
    p.set_defaults(run=cmd_image)

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
