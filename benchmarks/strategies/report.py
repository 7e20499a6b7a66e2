"""Turn the raw figures of ``results.json`` into ``results.md`` (tables and goals) and ``results.png``.

python benchmarks/strategies/report.py [RESULTS_DIR]    # redraw from RESULTS_DIR/results.json (default: results/ here)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import tables  # noqa: E402
from benchmarks.harness.records import read_json  # noqa: E402
from benchmarks.strategies.configs import (  # noqa: E402
    CHECKPOINT_FLOOR_BYTES_PER_TRAINABLE,
    CHECKPOINT_VS_FLOOR_GOAL,
    CONFIGS,
    LR_ZERO_VS_FROZEN_GOAL,
    MEMORY_VS_LIMIT_GOAL,
)

MiB = tables.MIB
REFERENCE = "frozen"  # (a): every ratio "x (a)" divides by this configuration
PLAIN = "plain"


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run: the worst rank for memory, rank 0 for times and the checkpoint."""
    ranks = run["ranks"]
    row: dict[str, Any] = {"model": run["model"], "config": run["config"], "devices": run["devices"]}
    errors = {phase: text for rank in ranks for phase, text in rank.get("errors", {}).items()}
    if run["returncode"] != 0:
        errors.setdefault("exit", f"exit status {run['returncode']}, see results/logs/")
    row["errors"] = errors
    if not ranks:
        return row
    first = ranks[0]
    estimate = first["estimate"]
    row["trainable_params"] = estimate["trainable_params"]
    row["frozen_params"] = estimate["frozen_params"]
    row["limit_bytes"] = estimate["limit_bytes"]
    row["checkpoint_floor_bytes"] = CHECKPOINT_FLOOR_BYTES_PER_TRAINABLE * estimate["trainable_params"]
    row["floor_rss"] = first["floor_rss"]
    if CONFIGS[run["config"]].estimated:
        row["estimate_bytes"] = estimate["device_bytes"] + estimate["host_bytes"]
    if all("train_peak_rss" in rank for rank in ranks) and len(ranks) == run["devices"]:
        row["memory_bytes"] = max(rank["train_peak_rss"] - rank["floor_rss"] for rank in ranks)
        row["setup_memory_bytes"] = max(rank["setup_peak_rss"] - rank["floor_rss"] for rank in ranks)
        row["heap_malloc_memory_bytes"] = max(rank["heap_malloc_peak_rss"] - rank["floor_rss"] for rank in ranks)
        row["step_s"] = first["step_median_s"]
    if all(rank.get("device_memory") for rank in ranks) and len(ranks) == run["devices"]:
        row["device_memory_bytes"] = max(rank["device_memory"]["train_peak"] for rank in ranks)
        row["device_estimate_bytes"] = estimate["device_bytes"]
    for key in ("checkpoint_bytes", "save_s", "next_save_s", "resume_s"):
        if key in first:
            row[key] = first[key]
    if all("resumed_exactly" in rank for rank in ranks) and ranks:
        row["resumed_exactly"] = all(rank["resumed_exactly"] for rank in ranks)
    if "estimate_bytes" in row and "memory_bytes" in row:
        row["estimate_error"] = row["memory_bytes"] / row["estimate_bytes"] - 1
    return row


def ratio(
    row: dict[str, Any], other: Optional[dict[str, Any]], key: str, other_key: Optional[str] = None
) -> Optional[float]:
    """``row[key] / other[other_key or key]``, or None when either is missing."""
    return None if other is None else tables.ratio(row.get(key), other.get(other_key or key))


def groups(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    grouped: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["model"], row["devices"]), {})[row["config"]] = row
    return grouped


def _cell(value: Optional[float], *ratios: Optional[float], digits: int = 1, unit: float = 1) -> str:
    """``value / unit`` and its ratios in brackets, or "failed" when it was not measured."""
    if value is None:
        return "failed"
    return f"{value / unit:.{digits}f} ({', '.join(tables.num(r) for r in ratios)})"


def goal_rows(grouped: dict[tuple[str, int], dict[str, dict[str, Any]]]) -> list[tuple[str, str, str, Optional[bool]]]:
    """(goal, where, measured, met) for each goal and each model/process count; met is None when not measured."""
    out: list[tuple[str, str, str, Optional[bool]]] = []
    for (model, devices), by_config in grouped.items():
        where = f"{model}, {devices}p"
        a, b, c = by_config.get(REFERENCE), by_config.get("stock"), by_config.get("frozen_lr0")
        if a is None:
            continue

        def check(goal: str, value: Optional[float], bound: float, text: str, where: str = where) -> None:
            out.append(
                (goal, where, text if value is not None else "not measured", None if value is None else value <= bound)
            )

        # on a GPU the memory goals are about device memory, against the estimate's device bytes
        if "device_memory_bytes" in a:
            memory_key, limit_key, what_memory, what_limit = (
                "device_memory_bytes",
                "device_estimate_bytes",
                "device memory",
                "estimate",
            )
        else:
            memory_key, limit_key, what_memory, what_limit = "memory_bytes", "limit_bytes", "memory", "limit"
        mem_b = ratio(a, b, memory_key)
        check(f"{what_memory} (a) ≤ (b)", mem_b, 1.0, f"{tables.num(mem_b)}× (b)")
        mem_limit = ratio(a, a, memory_key, limit_key)
        check(
            f"{what_memory} (a) ≤ {MEMORY_VS_LIMIT_GOAL}× {what_limit}",
            mem_limit,
            MEMORY_VS_LIMIT_GOAL,
            f"{tables.num(mem_limit)}× {what_limit}",
        )
        for key, what in ((memory_key, what_memory), ("step_s", "step time"), ("checkpoint_bytes", "checkpoint")):
            value = ratio(c, a, key) if c is not None else None
            check(
                f"(c) under ours: {what} within 10% of (a)", value, LR_ZERO_VS_FROZEN_GOAL, f"{tables.num(value)}× (a)"
            )
        ckpt_floor = ratio(a, a, "checkpoint_bytes", "checkpoint_floor_bytes")
        check(
            f"checkpoint (a) ≤ {CHECKPOINT_VS_FLOOR_GOAL}× floor",
            ckpt_floor,
            CHECKPOINT_VS_FLOOR_GOAL,
            f"{tables.num(ckpt_floor)}× floor",
        )
        step_b = ratio(a, b, "step_s")
        check("step time (a) ≤ (b)", step_b, 1.0, f"{tables.num(step_b)}× (b)")
    return out


def markdown(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    meta = results["meta"]
    grouped = groups(rows)
    lines = [
        "# lightning-frozen benchmark results",
        "",
        f"`{meta['command']}` — started {meta['started']}, {meta['wall_s']} s in all; {meta['host']};"
        f" load average (1, 5, 15 min) {meta['load_before']} before, {meta['load_after']} after;"
        f" {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}. {meta['setting']};"
        f" {meta['threads_per_process']} torch thread(s) per process.",
        "",
        "Memory: peak RSS per rank during the first 4 training steps above the floor (the RSS after all imports,"
        " just before the model is built), worst rank, with glibc's malloc mapping every allocation above 1 MiB so"
        " that RSS follows live memory. Heap malloc: the same over the timed steps, where glibc keeps buffers up"
        " to 32 MiB in its heap, as its default does once warm. Setup: the peak up to `on_train_start` (model"
        " build + engine setup)."
        " Limit: the physical limit per rank (frozen bytes / N, plus weight, fp32 master, Adam moments and gradient"
        " per trainable param)."
        " Checkpoint floor: 12 B per trainable param. Step: median of the 6 timed steps."
        " First save: the first `trainer.save_checkpoint` of the run; next save: the one right after it."
        " Resume: `fit(ckpt_path=...)` call → first batch. Ratios in brackets: × (a), then × limit/floor/(d).",
        "",
        "## Goals",
        "",
        "| goal | model, processes | measured | |",
        "|---|---|---|---|",
    ]
    for goal, where, measured, met in goal_rows(grouped):
        lines.append(f"| {goal} | {where} | {measured} | {'—' if met is None else 'met' if met else '**missed**'} |")
    for (model, devices), by_config in grouped.items():
        a, d = by_config.get(REFERENCE), by_config.get(PLAIN)
        any_row = next(iter(by_config.values()))
        lines += ["", f"## {model}, {devices} process{'es' if devices > 1 else ''}", ""]
        if "limit_bytes" in any_row:
            lines.append(
                f"{any_row['trainable_params']:,} trainable / {any_row['frozen_params']:,} frozen params."
                f" Limit per rank {any_row['limit_bytes'] / MiB:.1f} MiB; checkpoint floor"
                f" {any_row['checkpoint_floor_bytes'] / MiB:.2f} MiB; floor RSS {any_row['floor_rss'] / MiB:.0f} MiB."
            )
            lines.append("")
        device = any("device_memory_bytes" in row for row in by_config.values())
        lines += [
            "| configuration | memory MiB (×a, ×limit) | heap malloc MiB | setup MiB | checkpoint MiB (×a, ×floor)"
            " | first save s (×a) | next save s (×a) | resume s (×a) | resumed exactly | step s (×a, ×d)"
            " | estimate error |" + (" device MiB (×a, ×estimate) |" if device else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if device else ""),
        ]
        for key, row in by_config.items():
            lines.append(
                "| "
                + " | ".join(
                    [
                        CONFIGS[key].label + (" (DDP)" if key == PLAIN and devices > 1 else ""),
                        _cell(
                            row.get("memory_bytes"),
                            ratio(row, a, "memory_bytes"),
                            ratio(row, row, "memory_bytes", "limit_bytes"),
                            unit=MiB,
                        ),
                        tables.mib(row.get("heap_malloc_memory_bytes"), missing="failed"),
                        tables.mib(row.get("setup_memory_bytes"), missing="failed"),
                        _cell(
                            row.get("checkpoint_bytes"),
                            ratio(row, a, "checkpoint_bytes"),
                            ratio(row, row, "checkpoint_bytes", "checkpoint_floor_bytes"),
                            digits=2,
                            unit=MiB,
                        ),
                        _cell(row.get("save_s"), ratio(row, a, "save_s"), digits=2),
                        _cell(row.get("next_save_s"), ratio(row, a, "next_save_s"), digits=2),
                        _cell(row.get("resume_s"), ratio(row, a, "resume_s"), digits=2),
                        {True: "yes", False: "**no**", None: "—"}[row.get("resumed_exactly")],
                        _cell(row.get("step_s"), ratio(row, a, "step_s"), ratio(row, d, "step_s"), digits=3),
                        f"{row['estimate_error']:+.0%}" if "estimate_error" in row else "—",
                        *(
                            [
                                _cell(
                                    row.get("device_memory_bytes"),
                                    ratio(row, a, "device_memory_bytes"),
                                    ratio(row, row, "device_memory_bytes", "device_estimate_bytes"),
                                    unit=MiB,
                                )
                            ]
                            if device
                            else []
                        ),
                    ]
                )
                + " |"
            )
        failures = [(key, phase, text) for key, row in by_config.items() for phase, text in row["errors"].items()]
        for key, phase, text in failures:
            last = text.strip().splitlines()[-1] if text.strip() else text
            lines.append(f"\n- {CONFIGS[key].label}: {phase} failed: `{last[:300]}`")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], path: Path, setting: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    grouped = groups(rows)
    names = [f"{model}\n{devices} process{'es' if devices > 1 else ''}" for model, devices in grouped]
    panels = [
        ("memory_bytes", MiB, "peak RSS above the floor, per rank (MiB); dashed: physical limit", "limit_bytes"),
        *(
            [
                (
                    "device_memory_bytes",
                    MiB,
                    "peak device memory per rank (MiB); dashed: estimate",
                    "device_estimate_bytes",
                )
            ]
            if any("device_memory_bytes" in row for row in rows)
            else []
        ),
        ("checkpoint_bytes", MiB, "checkpoint size (MiB); dashed: 12 B per trainable param", "checkpoint_floor_bytes"),
        ("step_s", 1, "time per training step (s)", None),
        ("resume_s", 1, "resume: fit(ckpt_path) call to first batch (s)", None),
    ]
    configs = [key for key in CONFIGS if any(row["config"] == key for row in rows)]
    width = 0.8 / len(configs)
    colors = dict(zip(configs, plt.get_cmap("tab10").colors))
    columns = (len(panels) + 1) // 2
    figure, axes = plt.subplots(2, columns, figsize=(7.5 * columns, 10))
    for axis, (key, unit, title, limit_key) in zip(axes.flat, panels):
        for index, config in enumerate(configs):
            for group_index, by_config in enumerate(grouped.values()):
                x = group_index - 0.4 + width * (index + 0.5)
                row = by_config.get(config)
                if row is None:
                    continue
                if row.get(key):
                    axis.bar(x, row[key] / unit, width, color=colors[config])
                else:
                    axis.text(
                        x,
                        0.02,
                        "failed",
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        transform=axis.get_xaxis_transform(),
                    )
        for group_index, by_config in enumerate(grouped.values()):
            limit = next(iter(by_config.values())).get(limit_key) if limit_key else None
            if limit:
                axis.hlines(limit / unit, group_index - 0.45, group_index + 0.45, colors="black", linestyles="dashed")
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.set_title(title, fontsize=10)
        axis.set_xticks(range(len(names)), names)
        axis.grid(axis="y", which="both", alpha=0.3)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    handles = [Patch(color=colors[key], label=CONFIGS[key].label) for key in configs]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    figure.suptitle(f"lightning-frozen vs stock DeepSpeed ZeRO-3 and plain Lightning ({setting}; log scales)")
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(results: dict[str, Any], out_dir: Path) -> None:
    rows = [summarize(run) for run in results["runs"]]
    (out_dir / "results.md").write_text(markdown(results, rows))
    chart(rows, out_dir / "results.png", results["meta"]["setting"])


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results"
    write(read_json(out / "results.json"), out)
