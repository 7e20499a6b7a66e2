"""The steadiness check (issue 53): every step of a run, its spread, and its median beside a dense floor and a peer.

A row is one run's figures: ``name``, ``status``, ``steps_s`` (every step, warm-up first), ``timed`` (how many of the
last are timed), ``units_per_step`` (tokens, or rows, the step works on: ratios are per unit) and, where a canary ran
after each step (``probes.CanaryCycle``), ``canary``. The floor and the peer are rows of the same round, named. Imports
nothing heavy: a driver without torch uses it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Optional

from benchmarks.harness.tables import num, ratio, table

GOAL_SPREAD, GOAL_FLOOR = 1.15, 1.05  # every timed step within 1.15x the fastest; median <= 1.05x the dense floor


def timed_steps(row: dict[str, Any]) -> list[float]:
    """The row's timed steps (the warm-up left out)."""
    return row["steps_s"][len(row["steps_s"]) - row["timed"] :]


def spread(steps: Sequence[float]) -> float:
    """Slowest ÷ fastest."""
    return max(steps) / min(steps)


def per_unit(row: dict[str, Any]) -> float:
    """The median timed step over the units it works on."""
    return statistics.median(timed_steps(row)) / row["units_per_step"]


def after_each_canary(row: dict[str, Any]) -> dict[str, list[float]]:
    """The timed steps by the canary that ran just before them (``none``: none did)."""
    steps, canary = row["steps_s"], row.get("canary") or []
    first = len(steps) - row["timed"]
    grouped: dict[str, list[float]] = {}
    for index in range(max(first, 1), min(len(steps), len(canary) + 1)):
        grouped.setdefault(canary[index - 1]["kind"], []).append(steps[index])
    return grouped


def canary_cell(row: dict[str, Any]) -> str:
    """The copy rate and the two-thread matmul's worth in single threads after each timed step."""
    samples = (row.get("canary") or [])[len(row["steps_s"]) - row["timed"] :]
    return ", ".join(
        "—" if c["kind"] == "none" else "{copy_gib_s:.1f} / {threads_worth:.2f}".format(**c) for c in samples
    )


def round_lines(
    rounds: Sequence[Sequence[dict[str, Any]]], floor: Optional[str], peer: Optional[str], unit: str = "token"
) -> list[str]:
    """Every timed step of every round with the canary after it, the spread, and the median per ``unit`` ÷ the same
    round's ``floor`` and ``peer`` rows; then, where the canary cycle had more than one kind, the steps grouped by the
    canary before them; then the goals."""
    rows, by_canary = [], []
    for number, runs in enumerate(rounds, 1):
        ok = {r["name"]: r for r in runs if r["status"] == "ok"}
        floor_unit = per_unit(ok[floor]) if floor in ok else None
        peer_unit = per_unit(ok[peer]) if peer in ok else None
        for row in runs:
            if row["status"] != "ok":
                rows.append([number, row["name"], f"{row['status']} {row.get('reason') or ''}", "", "", "", "", ""])
                continue
            timed = timed_steps(row)
            rows.append(
                [
                    number,
                    row["name"],
                    ", ".join(f"{s:.2f}" for s in timed),
                    canary_cell(row),
                    f"{statistics.median(timed):.2f}",
                    f"{spread(timed):.2f}",
                    num(ratio(per_unit(row), floor_unit)),
                    num(ratio(per_unit(row), peer_unit)),
                ]
            )
            grouped = after_each_canary(row)
            if len(grouped) > 1:
                cells = [f"{kind}: {statistics.median(s):.2f} ({len(s)})" for kind, s in sorted(grouped.items())]
                by_canary.append([number, row["name"], "; ".join(cells)])
    header = ["round", "run", "timed steps (s)", "canary: copy GiB/s / threads worth", "median s", "spread"]
    lines = table([*header, f"÷ floor per {unit}", f"÷ peer per {unit}"], rows)
    if by_canary:
        lines += [
            "",
            "Median step after each kind of canary, side by side in one process (steps counted):",
            "",
            *table(["round", "run", "after canary"], by_canary),
        ]
    return [
        *lines,
        "",
        f"Goals (issue 53): spread ≤ {GOAL_SPREAD}; ours' median ≤ {GOAL_FLOOR}x the floor ({floor or 'none here'})"
        f" and ≤ the peer ({peer or 'none here'}).",
        "",
    ]
