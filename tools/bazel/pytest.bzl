"""py_pytest: one pytest file as one Bazel py_test, reporting junit XML to Bazel."""

def py_pytest(name, src, deps = [], data = [], size = "small", tags = [], args = [], **kwargs):
    """A py_test running `src` under pytest.

    Tags: "gpu" (needs CUDA; excluded unless --config=gpu), "vllm" (starts real vLLM), "slow".
    """
    native.py_test(
        name = name,
        srcs = [src, "//tools/bazel:pytest_main.py"],
        main = "//tools/bazel:pytest_main.py",
        args = ["$(location %s)" % src] + args,
        deps = deps,
        data = data,
        size = size,
        tags = tags,
        python_version = "PY3",
        **kwargs
    )
