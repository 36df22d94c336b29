"""Prints "N passed, N failed[, N skipped]" for a `bazel test` run and exits with its verdict.

Reads the Build Event Protocol JSON file of the run: every test target's final attempt, counted
per test case from its junit XML (pytest writes one per target). A target that failed without
reporting a failed case (a crash, a timeout, a build error) counts as one failed. Stdlib only:
CI runs it even when the venv could not be created.

Usage: python3 tools/ci_summary.py BEP_JSON BAZEL_EXIT_CODE
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    skipped: int = 0

    def line(self) -> str:
        text = f"{self.passed} passed, {self.failed} failed"
        return text + (f", {self.skipped} skipped" if self.skipped else "")


def _count_cases(xml_path: Path) -> Counts:
    """Counts a target's test cases; a report that cannot be read (the run was cut short, the
    disk filled up) counts none, and the target's own status then decides."""
    counts = Counts()
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError) as error:
        print(f"ci: unreadable test report {xml_path}: {error}", file=sys.stderr)
        return counts
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            counts.failed += 1
        elif "skipped" in tags:
            counts.skipped += 1
        else:
            counts.passed += 1
    return counts


def _final_results(bep_path: Path) -> dict[str, dict]:
    """Maps each test label to the BEP testResult of its last attempt."""
    results: dict[str, tuple[int, dict]] = {}
    for line in bep_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a file cut short: the bazel exit code still fails the run
            print(f"ci: unreadable build event in {bep_path}: {line[:80]!r}", file=sys.stderr)
            continue
        test_id = event.get("id", {}).get("testResult")
        if test_id is None or "testResult" not in event:
            continue
        attempt = test_id.get("attempt", 1)
        label = f"{test_id['label']}#{test_id.get('shard', 0)}"
        if label not in results or attempt >= results[label][0]:
            results[label] = (attempt, event["testResult"])
    return {label: result for label, (_, result) in results.items()}


def summarize(bep_path: Path, bazel_status: int) -> Counts:
    total = Counts()
    for label, result in sorted(_final_results(bep_path).items()):
        xml_files = [
            Path(unquote(urlparse(out["uri"]).path))
            for out in result.get("testActionOutput", [])
            if out.get("name") == "test.xml"
        ]
        counts = _count_cases(xml_files[0]) if xml_files else Counts()
        if result.get("status") != "PASSED" and counts.failed == 0:
            print(f"ci: {label} {result.get('status')} without a failed test case", file=sys.stderr)
            counts.failed = 1
        total.passed += counts.passed
        total.failed += counts.failed
        total.skipped += counts.skipped
    if bazel_status != 0 and total.failed == 0:
        print(f"ci: bazel exited {bazel_status} (build or setup failure)", file=sys.stderr)
        total.failed = 1
    return total


def main() -> int:
    bep_path, bazel_status = Path(sys.argv[1]), int(sys.argv[2])
    counts = summarize(bep_path, bazel_status) if bep_path.exists() else Counts(failed=1)
    print(counts.line())
    return 0 if counts.failed == 0 and bazel_status == 0 and counts.passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
