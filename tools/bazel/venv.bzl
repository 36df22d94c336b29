"""A Python toolchain whose interpreter is the repo's .venv (created by ./bazelw).

Nothing is downloaded: the repository rule only writes a BUILD file pointing at
<workspace>/.venv/bin/python3. It reads requirements.lock so that a lock change re-runs it.
"""

def _venv_python_impl(rctx):
    workspace = rctx.path(Label("//:WORKSPACE")).dirname
    rctx.read(Label("//:requirements.lock"))  # a dependency: re-run when the lock changes
    interpreter = "%s/.venv/bin/python3" % workspace
    rctx.file("BUILD.bazel", """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    stub_shebang = "#!{interpreter}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(interpreter = interpreter))

venv_python = repository_rule(
    implementation = _venv_python_impl,
    local = True,
)
