"""Entry point of every py_pytest target: runs pytest on the given files, junit XML to Bazel."""

import os
import sys

import pytest


def main() -> int:
    args = [*sys.argv[1:], "-p", "no:cacheprovider", "--import-mode=importlib", "-q"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args += ["--junitxml", xml]
    return pytest.main(args)


if __name__ == "__main__":
    sys.exit(main())
