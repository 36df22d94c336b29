"""Entry point of every py_pytest target: runs pytest on the given files, junit XML to Bazel."""

import os
import sys

import pytest


def main() -> int:
    args = [*sys.argv[1:], "-p", "no:cacheprovider", "--import-mode=importlib", "-q"]
    # The project's one custom marker: tests that need compiled CUDA kernels. A file mixing
    # both kinds runs as two targets, one with `-m "not cuda"`, one tagged "gpu".
    args += ["-o", "markers=cuda: needs a CUDA GPU"]
    # tmp_path under Bazel's per-test folder, not /tmp/pytest-of-$USER, where every run's
    # files (GBs of unpacked images) would stay behind.
    if "TEST_TMPDIR" in os.environ:
        args += ["--basetemp", os.path.join(os.environ["TEST_TMPDIR"], "pytest")]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args += ["--junitxml", xml]
    return pytest.main(args)


if __name__ == "__main__":
    sys.exit(main())
