"""Is every step the same? Rounds of the 1.1B-shaped LoRA runs of ``peer_qlora/run.py``, every step time reported.

    python benchmarks/steadiness/run.py [--runs 3] [--steps 8] [--data-dir /work/bench-data] [--out DIR]

Each round runs, one after another in fresh processes: the dense fp32 plain loop (the floor: transformers + PEFT),
the QLoRA peer (bitsandbytes NF4), and ``frozen_deepspeed`` with ``frozen_dtype="nf4"`` on 1 and on 2 ranks; one
warm-up step, then ``--steps`` timed ones. Each step is followed, outside its time, by fixed work
(``MachineCanary``: a 64 MiB copy, a matmul on one thread and on both): a step that is slow while the canary is not
points at the process, both slow at the machine. The canary's two matmuls also tell whether the two vCPUs compute as
two cores (``threads_worth`` near 2) or share one (near 1: hyperthreads of one core). Ours also records the CPU
seconds each of its threads used in every step.

Goals (issue 53), per round on the 2-core CPU:
- spread: every timed step within 1.15x of the round's fastest;
- ours' median within 1.05x of the dense floor's, and at most the QLoRA peer's (per token on 2 ranks).

Writes ``<out>/steadiness.json`` and ``<out>/steadiness.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from benchmarks.harness.probes import load_average, machine  # noqa: E402
from benchmarks.harness.records import now_utc, write_json  # noqa: E402
from benchmarks.peer_qlora import run as peer_qlora  # noqa: E402

GOAL_SPREAD, GOAL_FLOOR = 1.15, 1.05
RUNS = (("peer dense", "peer", False, 1), ("peer QLoRA", "peer", True, 1), ("ours NF4 1r", "ours", "nf4", 1),
        ("ours NF4 2r", "ours", "nf4", 2))  # fmt: skip


def one_round(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    rows = []
    for name, kind, option, devices in RUNS:
        if args.only and name not in args.only:
            continue
        if kind == "peer":
            row = peer_qlora.run_peer(name, option, folder, args)
        else:
            row = peer_qlora.run_ours(name, option, devices, args)
        if row["status"] == "ok":
            timed = row["steps_s"][args.warmup :]
            row["timed_s"] = timed
            row["median_s"] = statistics.median(timed)
            row["spread"] = max(timed) / min(timed)
            row["per_token_s"] = row["median_s"] / row["tokens_per_step"]
        rows.append(row)
    return rows


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Steadiness: every step of the 1.1B-shaped LoRA runs, round by round",
        "",
        f"Written by `benchmarks/steadiness/run.py` on {result['date']} ({result['machine']}; load average"
        f" {result['load_before']} before, {result['load_after']} after). 64 tokens per sequence and rank, fp32"
        " compute, LoRA r=8 on q/v. Spread: slowest timed step ÷ fastest. Floor: the dense fp32 plain loop of the"
        " same round; peer: the QLoRA peer of the same round (per token).",
        "",
        "| round | run | timed steps (s) | canary: copy GiB/s / threads worth | median s | spread | ÷ floor | ÷ peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for number, rows in enumerate(result["rounds"], 1):
        by_name = {r["name"]: r for r in rows if r["status"] == "ok"}
        floor, peer = by_name.get("peer dense"), by_name.get("peer QLoRA")
        for row in rows:
            if row["status"] != "ok":
                lines.append(f"| {number} | {row['name']} | {row['status']} {row.get('reason') or ''} | | | | | |")
                continue
            canary = ", ".join(
                "{copy_gib_s:.1f} / {threads_worth:.2f}".format(**c)
                for c in row.get("canary", [])[len(row["steps_s"]) - len(row["timed_s"]) :]
            )
            to_floor = row["per_token_s"] / floor["per_token_s"] if floor else None
            to_peer = row["per_token_s"] / peer["per_token_s"] if peer else None
            lines.append(
                f"| {number} | {row['name']} | {', '.join(f'{s:.2f}' for s in row['timed_s'])} |"
                f" {canary} | {row['median_s']:.2f} | {row['spread']:.2f} |"
                f" {'' if to_floor is None else f'{to_floor:.2f}'} | {'' if to_peer is None else f'{to_peer:.2f}'} |"
            )
    lines += [
        "",
        f"Goals (issue 53): spread ≤ {GOAL_SPREAD}; ours' median ≤ {GOAL_FLOOR}x the floor and ≤ 1.0x the peer.",
        "",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="rounds")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    parser.add_argument("--only", nargs="+", help="run only these names (e.g. 'peer dense' 'ours NF4 1r')")
    parser.add_argument("--data-dir", type=Path, default=Path("/work/bench-data"))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    folder = peer_qlora.write_folder(args.data_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = load_average()[0]
    rounds = [one_round(args, folder) for _ in range(args.runs)]
    result = dict(date=now_utc(), load_before=load_before, load_after=load_average()[0], machine=machine())
    result["rounds"] = rounds
    write_json(args.out / "steadiness.json", result)
    (args.out / "steadiness.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
