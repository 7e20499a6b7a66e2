"""The records a benchmark keeps: each rank's ``rank<R>.json`` in a run directory, and the study's results file.

A rank rewrites its report after every phase (:class:`RankReport`), atomically, so that a driver reading it while
the rank runs, or after the rank was killed, finds the figures of every phase it finished. Standard library only.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def write_json(path: Path, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON in one step (a reader never sees half a file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


class RankReport:
    """This rank's figures, rewritten to ``<run_dir>/rank<R>.json`` after each update (R: ``LOCAL_RANK``)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.figures: dict[str, Any] = {"rank": self.rank, "errors": {}}

    def update(self, **figures: Any) -> None:
        self.figures.update(figures)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(self.run_dir / f"rank{self.rank}.json", self.figures)

    def error(self, phase: str) -> None:
        """Record the exception being handled as the failure of ``phase``."""
        self.figures["errors"][phase] = traceback.format_exc(limit=-3)
        self.update()


def read_rank_reports(run_dir: Path) -> list[dict[str, Any]]:
    """Every ``rank<R>.json`` in ``run_dir``, in rank order; the ``running<R>.json`` peaks a rank's sampler last
    wrote (the phase it was in) as its ``running_peaks``."""
    reports = sorted((read_json(p) for p in run_dir.glob("rank*.json")), key=lambda r: r.get("rank", 0))
    for report in reports:
        running = run_dir / f"running{report.get('rank', 0)}.json"
        if running.exists():
            report["running_peaks"] = read_json(running)
    return reports


def rank_errors(run_dir: Path) -> list[str]:
    """The phases that failed in ``run_dir``'s rank reports so far (a report being replaced is skipped)."""
    errors = []
    for path in run_dir.glob("rank*.json"):
        try:
            errors += list(read_json(path).get("errors") or {})
        except (OSError, ValueError):
            continue
    return errors


def append_record(path: Path, record: dict[str, Any], key: str = "records") -> dict[str, Any]:
    """Add ``record`` to the list ``key`` of the results file ``path`` (created if missing); return its content."""
    data = read_json(path) if path.exists() else {key: []}
    data[key].append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)
    return data


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def host() -> str:
    """The interpreter and machine a run used."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def versions() -> dict[str, str]:
    """The versions of the libraries every figure depends on."""
    return {name: version(name) for name in ("torch", "lightning", "deepspeed", "peft", "transformers")}


def git_commit() -> str:
    """The checkout's short commit, ``+dirty`` when tracked files differ from it."""

    def git(*words: str) -> str:
        return subprocess.run(["git", *words], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (
        "+dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    )
