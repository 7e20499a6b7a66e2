"""Markdown tables of the figures: rows, cells, units and ratios, each missing figure shown as such."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

MIB, GIB = 2**20, 2**30


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: ``header``, the separator, one line per row (cells as given, ``str()``-ed)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """``value / base``, or None when either is missing or ``base`` is 0."""
    return None if value is None or not base else value / base


def num(value: Optional[float], digits: int = 2, missing: str = "—") -> str:
    return missing if value is None else f"{value:.{digits}f}"


def mib(value: Optional[float], digits: int = 1, missing: str = "") -> str:
    return missing if value is None else f"{value / MIB:.{digits}f}"


def gib(value: Optional[float], digits: int = 2, missing: str = "") -> str:
    return missing if value is None else f"{value / GIB:.{digits}f}"


def load_note(before: Any, after: Any) -> str:
    """The machine's load around a run, which every timing depends on."""
    return f"load average {before} before, {after} after"
