"""The two reports of scripts/drift_check.sh, which runs this file with its scratch venv's Python.

``names``: each package's version against the release the package was written for, and every private name of
:mod:`lightning_frozen.capabilities`' table that moved, by the capability that needs it.
``tests LOG``: the counts and each failing test's id with its one-line error, read from the output of ``pytest -ra``.
Both exit 1 when something moved or broke.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# the final line of `pytest -q`: "2 failed, 550 passed, 14 skipped, 3 warnings in 612.40s (0:10:12)"
COUNTS_LINE = re.compile(r"^=*\s*(\d+ \w+(?:, \d+ \w+)*) in [\d.]+s\b")
COUNT = re.compile(r"(\d+) (\w+)")
# a line of `-ra`'s short test summary: "FAILED tests/test_x.py::test_y[a] - AssertionError: assert 1 == 2"
OUTCOME_LINE = re.compile(r"^(FAILED|ERROR) (.+?)(?: - (.*))?$")


@dataclass
class TestRun:
    """What a pytest run's output says: the count of each outcome, and one line per failed test or error."""

    counts: dict[str, int] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return bool(self.counts)


def read_test_run(output: str) -> TestRun:
    """The counts (``errors`` and ``warnings`` as pytest spells them in the plural) and the ``FAILED`` / ``ERROR``
    lines of ``output``, each as ``"FAILED id - error"``; no counts where pytest ended without its final line."""
    run = TestRun()
    for line in output.splitlines():
        if match := OUTCOME_LINE.match(line):
            kind, test_id, error = match.groups()
            run.broken.append(f"{kind} {test_id}" + (f" - {error}" if error else ""))
        elif match := COUNTS_LINE.match(line):
            run.counts = {_plural(word): int(number) for number, word in COUNT.findall(match.group(1))}
    return run


def _plural(word: str) -> str:
    return {"error": "errors", "warning": "warnings"}.get(word, word)


def report_tests(log: Path) -> int:
    run = read_test_run(log.read_text(errors="replace"))
    if not run.finished:
        print(f"pytest ended without its summary line: see {log}")
        return 1
    print("tests: " + ", ".join(f"{number} {word}" for word, number in run.counts.items()))
    for line in run.broken:
        print(f"  {line}")
    return 1 if run.counts.get("failed") or run.counts.get("errors") or run.broken else 0


def report_names() -> int:
    # DeepSpeed's logger writes to the stdout it finds at import: its notices go to stderr, the report alone to stdout
    with contextlib.redirect_stdout(sys.stderr):
        # imported here: `tests` reads a log without the package; `names` runs where the releases under test are
        from lightning_frozen import capabilities
        from lightning_frozen.foreign_names import WRITTEN_FOR, installed_version, moved_message

        found = (capabilities.CORE, *capabilities.OPTIONAL)
        moved = [(capability, *name) for capability in found for name in capabilities.moved_names(capability)]
    print("versions (installed, written for):")
    for package, version in WRITTEN_FOR.items():
        installed = installed_version(package)
        print(f"  {package:<13} {installed or 'not installed':<14} {version}")
    print(f"private names: {len(moved)} of {len(capabilities.ROWS)} moved")
    for capability, row, problem in moved:
        kind = f"{capability.name} off: {capability.fallback}" if capability.fallback else "core: DependencyDriftError"
        print(f"  {moved_message(row, problem)} [{kind}]")
    return 1 if moved else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    reports = parser.add_subparsers(dest="report", required=True)
    reports.add_parser("names", help="versions and moved private names of the installed packages")
    tests = reports.add_parser("tests", help="counts and failing tests from the output of `pytest -ra`")
    tests.add_argument("log", type=Path)
    arguments = parser.parse_args(argv)
    return report_names() if arguments.report == "names" else report_tests(arguments.log)


if __name__ == "__main__":
    sys.exit(main())
