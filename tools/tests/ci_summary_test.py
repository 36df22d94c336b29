"""Tests of tools/ci_summary.py: the line and verdict CI prints from a Bazel run's events."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PASSING_REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="a" name="one"/>
<testcase classname="a" name="two"/>
<testcase classname="a" name="three"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>"""


def _event(label: str, status: str, report: Path, attempt: int = 1) -> str:
    return json.dumps(
        {
            "id": {"testResult": {"label": label, "attempt": attempt, "shard": 0}},
            "testResult": {
                "status": status,
                "testActionOutput": [{"name": "test.xml", "uri": report.as_uri()}],
            },
        }
    )


def _summarize(tmp_path: Path, events: list[str], bazel_status: int) -> subprocess.CompletedProcess:
    bep = tmp_path / "bep.json"
    bep.write_text("\n".join(events) + "\n")
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "ci_summary.py"), str(bep), str(bazel_status)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_counts_cases_of_every_target(tmp_path):
    report = tmp_path / "ok.xml"
    report.write_text(PASSING_REPORT)
    run = _summarize(tmp_path, [_event("//a:test", "PASSED", report)], 0)
    assert run.stdout.strip() == "2 passed, 0 failed, 1 skipped"
    assert run.returncode == 0


def test_only_the_last_attempt_counts(tmp_path):
    report = tmp_path / "ok.xml"
    report.write_text(PASSING_REPORT)
    broken = tmp_path / "broken.xml"
    broken.write_text("")
    events = [
        _event("//a:test", "FAILED", broken, attempt=1),
        _event("//a:test", "PASSED", report, attempt=2),
    ]
    run = _summarize(tmp_path, events, 0)
    assert run.stdout.strip() == "2 passed, 0 failed, 1 skipped"
    assert run.returncode == 0


def test_a_cut_short_report_is_a_failed_target_not_a_crash(tmp_path):
    """A full disk leaves an empty or truncated test.xml behind: the target counts as failed and
    the summary line still prints."""
    report = tmp_path / "ok.xml"
    report.write_text(PASSING_REPORT)
    truncated = tmp_path / "truncated.xml"
    truncated.write_text(PASSING_REPORT[:120])
    empty = tmp_path / "empty.xml"
    empty.write_text("")
    events = [
        _event("//a:test", "PASSED", report),
        _event("//b:test", "FAILED", truncated),
        _event("//c:test", "FAILED", empty),
        _event("//d:test", "FAILED", tmp_path / "missing.xml"),
    ]
    run = _summarize(tmp_path, events, 3)
    assert run.stdout.strip() == "2 passed, 3 failed, 1 skipped"
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert "unreadable test report" in run.stderr and "truncated.xml" in run.stderr


def test_a_failed_build_with_no_test_fails(tmp_path):
    run = _summarize(tmp_path, [], 1)
    assert run.stdout.strip() == "0 passed, 1 failed"
    assert run.returncode == 1
