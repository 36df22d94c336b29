"""OCI image rules of our own (no Docker daemon; rules_oci cannot be fetched offline).

Each rule runs one step of //tools/oci:build; every output is deterministic (sorted tar entries,
mtime 0, uid/gid 0 for what we add, canonical JSON):

  debian_rootfs    root filesystem layer from a pinned Debian package list (mmdebstrap)
  oci_pip_layer    Python packages of a hashed lock file, as a layer
  oci_files_layer  a py_binary's runfiles (its sources and generated modules), as a layer
  oci_image        oci-archive: a base image's layers, byte for byte, + layers + config
  oci_pinned_base  a base pulled elsewhere, pinned by digest, from the local cache (macro)
"""

_TOOL = "//tools/oci:build"

# Steps that fetch packages (pinned by version and hash) and need root (mmdebstrap) or the
# machine's pip cache and wheel folder.
_FETCHES = {
    "no-sandbox": "1",
    "requires-network": "1",
}

def _debian_rootfs_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar")
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = ["rootfs", "--packages", ctx.file.packages.path, "--out", out.path],
        inputs = [ctx.file.packages],
        outputs = [out],
        mnemonic = "DebianRootfs",
        progress_message = "Building Debian root filesystem %s" % ctx.label,
        execution_requirements = _FETCHES,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

debian_rootfs = rule(
    implementation = _debian_rootfs_impl,
    doc = "A Debian root filesystem layer (.tar) from a package list pinned by tools.oci.pin_debian.",
    attrs = {
        "packages": attr.label(allow_single_file = True, mandatory = True),
        "_tool": attr.label(default = _TOOL, executable = True, cfg = "exec"),
    },
)

def _oci_pip_layer_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar")
    args = ["pip-layer", "--lock", ctx.file.lock.path, "--python", ctx.attr.python]
    args += ["--prefix", ctx.attr.prefix, "--out", out.path]
    if ctx.attr.compile:
        args.append("--compile")
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = args,
        inputs = [ctx.file.lock],
        outputs = [out],
        mnemonic = "PipLayer",
        progress_message = "Installing %s into a layer" % ctx.file.lock.short_path,
        execution_requirements = _FETCHES,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

oci_pip_layer = rule(
    implementation = _oci_pip_layer_impl,
    doc = "The packages of a hashed lock (tools.oci.lock) installed under `prefix`, as a layer.",
    attrs = {
        "lock": attr.label(allow_single_file = True, mandatory = True),
        "python": attr.string(mandatory = True, doc = "the image's CPython, e.g. 3.11"),
        "prefix": attr.string(mandatory = True),
        "compile": attr.bool(doc = "add .pyc files; needs the build's Python to be `python`"),
        "_tool": attr.label(default = _TOOL, executable = True, cfg = "exec"),
    },
)

def _oci_files_layer_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar")
    binary = ctx.attr.binary[DefaultInfo]
    launcher = binary.files_to_run.executable
    files = {}
    for f in binary.default_runfiles.files.to_list():
        # The launcher names the build machine's interpreter; images run `python3 -m MODULE`.
        if f == launcher or f.short_path.startswith("../"):
            continue
        files[ctx.attr.prefix + "/" + f.short_path] = f.path
    manifest = ctx.actions.declare_file(ctx.label.name + ".files.json")
    ctx.actions.write(manifest, json.encode(files))
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = ["files-layer", "--files", manifest.path, "--out", out.path],
        inputs = depset([manifest], transitive = [binary.default_runfiles.files]),
        outputs = [out],
        mnemonic = "FilesLayer",
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

oci_files_layer = rule(
    implementation = _oci_files_layer_impl,
    doc = "A py_binary's runfiles under `prefix` (the workspace root, for PYTHONPATH), as a layer.",
    attrs = {
        "binary": attr.label(mandatory = True),
        "prefix": attr.string(mandatory = True),
        "_tool": attr.label(default = _TOOL, executable = True, cfg = "exec"),
    },
)

def _oci_image_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar")
    digest = ctx.actions.declare_file(ctx.label.name + ".digest")
    spec = ctx.actions.declare_file(ctx.label.name + ".spec.json")
    ctx.actions.write(spec, json.encode({
        "entrypoint": ctx.attr.entrypoint,
        "cmd": ctx.attr.cmd,
        "env": ctx.attr.env,
        "user": ctx.attr.user,
        "workdir": ctx.attr.workdir,
        "exposed_ports": ctx.attr.exposed_ports,
        "labels": ctx.attr.labels,
        "layer_comments": ["tandem %s" % layer.label for layer in ctx.attr.layers],
    }))
    args = ["image", "--spec", spec.path, "--ref", ctx.attr.ref or ctx.label.name]
    args += ["--out", out.path, "--digest-out", digest.path]
    inputs = [spec] + ctx.files.layers
    if ctx.file.base:
        args += ["--base", ctx.file.base.path, "--base-name", ctx.attr.base_name]
        inputs.append(ctx.file.base)
    for layer in ctx.files.layers:
        args += ["--layer", layer.path]
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = args,
        inputs = inputs,
        outputs = [out, digest],
        mnemonic = "OciImage",
        progress_message = "Writing image %s" % ctx.label,
    )
    return [
        DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out, digest])),
        OutputGroupInfo(digest = depset([digest])),
    ]

oci_image = rule(
    implementation = _oci_image_impl,
    doc = """An oci-archive (<name>.tar) of one linux/amd64 image, and its manifest digest
(<name>.digest). The base's layers come first, unchanged; the base's environment and labels are
kept unless overridden; entrypoint, cmd, user, workdir and exposed ports are this rule's.""",
    attrs = {
        "base": attr.label(allow_single_file = True, doc = "an oci-archive; none: from scratch"),
        "base_name": attr.string(doc = "the base's reference (an annotation)"),
        "layers": attr.label_list(allow_files = [".tar"]),
        "entrypoint": attr.string_list(),
        "cmd": attr.string_list(),
        "env": attr.string_dict(),
        "user": attr.string(),
        "workdir": attr.string(),
        "exposed_ports": attr.string_list(doc = "\"8000/tcp\""),
        "labels": attr.string_dict(),
        "ref": attr.string(doc = "the archive's org.opencontainers.image.ref.name; default: name"),
        "_tool": attr.label(default = _TOOL, executable = True, cfg = "exec"),
    },
)

def _missing_base_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar")
    ctx.actions.run_shell(
        outputs = [out],
        command = "echo \"$1\" >&2; exit 1",
        arguments = [ctx.attr.message],
        mnemonic = "MissingBase",
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

_missing_base = rule(
    implementation = _missing_base_impl,
    attrs = {"message": attr.string(mandatory = True)},
)

def oci_pinned_base(name, ref, digest, cache_dir, **kwargs):
    """A base image pulled on a machine with registry access, pinned by digest.

    The base is read from `cache_dir`/<digest with ":" as "-">.tar (an oci-archive, relative to
    this package). Without that file the target fails at build time, naming the command that
    fills the cache.

    Args:
      name: target name (an oci-archive file, for oci_image's `base`).
      ref: repository, e.g. "docker.io/library/python".
      digest: "sha256:<hex>".
      cache_dir: folder of the cache, relative to this package (ignored by git).
      **kwargs: tags, visibility, testonly.
    """
    cached = "%s/%s.tar" % (cache_dir, digest.replace(":", "-"))
    found = native.glob([cached], allow_empty = True)
    if found:
        native.filegroup(name = name, srcs = found, **kwargs)
        return
    package = native.package_name()
    _missing_base(
        name = name,
        message = ("base image %s@%s is not in the local cache (%s/%s). Fill it on a machine " +
                   "with registry access, from the repository root:\n  skopeo copy " +
                   "--override-os linux --override-arch amd64 docker://%s@%s oci-archive:%s/%s") %
                  (ref, digest, package, cached, ref, digest, package, cached),
        **kwargs
    )
