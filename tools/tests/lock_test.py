"""Tests of tools/lock.py's pieces that tools.oci.lock shares: reading a pip report, reading
requirements files, writing lock lines. (Resolving itself is pip's, and needs its index.)"""

from __future__ import annotations

import pytest

from tools.lock import lock_lines, report_pins, requirement_lines


def _install(name: str, version: str, hashes: dict) -> dict:
    return {
        "metadata": {"name": name, "version": version},
        "download_info": {"archive_info": {"hashes": hashes}},
    }


def test_report_pins_name_each_package_lower_case_with_its_version_and_sha256():
    installs = [
        _install("PyYAML", "6.0.2", {"sha256": "aa"}),
        _install("typing_extensions", "4.16.0", {"sha256": "bb", "md5": "cc"}),
    ]
    assert report_pins(installs) == {
        "pyyaml": ("6.0.2", "aa"),
        "typing_extensions": ("4.16.0", "bb"),
    }


def test_report_pins_refuse_a_file_without_sha256():
    with pytest.raises(SystemExit, match="no sha256 for torch"):
        report_pins([_install("torch", "2.13.0", {"md5": "cc"})])
    local = {"metadata": {"name": "torch", "version": "2.13.0"}, "download_info": {}}
    with pytest.raises(SystemExit, match="no sha256 for torch"):
        report_pins([local])


def test_requirement_lines_drop_comments_and_blank_lines(tmp_path):
    path = tmp_path / "requirements.in"
    path.write_text("# header\n\ntorch==2.13.0   # the CPU build\n  numpy\n#numpy\n")
    assert requirement_lines(path) == ["torch==2.13.0", "numpy"]


def test_lock_lines_pin_each_package_to_its_file_by_name():
    packages = {"torch": ("2.13.0", "bb"), "numpy": ("2.3.0", "aa")}
    assert lock_lines(packages) == [
        "numpy==2.3.0 \\\n    --hash=sha256:aa",
        "torch==2.13.0 \\\n    --hash=sha256:bb",
    ]
