"""Fail unless a pytest JUnit XML report shows tests that really ran and none that failed.

pytest exits 0 when every test was skipped; CI must not call that a pass.

Usage: python3 .ci/check_pytest_report.py REPORT.xml
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass


@dataclass(frozen=True)
class PytestCounts:
    tests: int
    failures: int
    errors: int
    skipped: int

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped


def read_counts(path: str) -> PytestCounts:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise ValueError(f"{path}: no <testsuite> element (not a pytest JUnit report?)")
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in total:
            total[k] += int(s.get(k, 0))
    return PytestCounts(**total)


def verdict(c: PytestCounts) -> str | None:
    """None when the run counts as a pass, else the one-line reason it does not."""
    if c.tests == 0:
        return "pytest collected no tests"
    if c.failures or c.errors:
        return f"{c.failures} failed, {c.errors} errors"
    if c.passed <= 0:
        return f"all {c.tests} tests were skipped: nothing was actually tested"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_pytest_report.py REPORT.xml", file=sys.stderr)
        return 2
    try:
        counts = read_counts(argv[0])
    except (OSError, ET.ParseError, ValueError) as e:
        print(f"CI: cannot read the pytest report: {e}", file=sys.stderr)
        return 1
    why = verdict(counts)
    if why:
        print(f"CI: FAIL ({why}; {counts.errors} errors)", file=sys.stderr)
    else:
        print(f"CI: pytest report OK ({counts.errors} errors)")
    # the closing line, in the plain 'N passed, N failed, N skipped' form (errors count as failed)
    print(f"CI: {counts.passed} passed, {counts.failures + counts.errors} failed, {counts.skipped} skipped",
          flush=True)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
