"""The peer a CPU user would run, side by side with ``frozen_deepspeed``: LoRA on a TinyLlama-1.1B-shaped folder.

    python benchmarks/peer_qlora/run.py [--steps 4] [--warmup 1] [--rounds 1] [--data-dir /work/bench-data] [--out DIR]
    python benchmarks/peer_qlora/run.py --rounds 3 --steps 8 --only "peer dense" "peer QLoRA" "ours NF4 1r" \
        "ours NF4 2r"

One run, one configuration at a time, each in fresh processes, on the same folder (written once by
``benchmarks/big_model/run.py write``: Llama, hidden 2048, 22 layers, grouped-query attention, bf16 safetensors), the
same random tokens (64 per sequence, one sequence per rank and step), LoRA r=8 on ``q_proj``/``v_proj``, AdamW, fp32
compute, on all the machine's cores:

- ``peer dense``: transformers + PEFT, the base loaded in fp32, a plain training loop;
- ``peer QLoRA``: transformers + bitsandbytes NF4 (``BitsAndBytesConfig(load_in_4bit=True, nf4)``) + PEFT, plain loop;
- ``ours NF4 1r`` / ``2r``: ``frozen_deepspeed`` with ``frozen_dtype="nf4"``, 1 and 2 ranks (``big_model/run.py``'s
  worker: ``from_pretrained`` in ``configure_model``; 2 ranks each take one core and one sequence);
- ``ours bf16 1r``: ``frozen_dtype="bf16"`` (a cast) under fp32 compute.

Step: median wall time of the timed steps (forward, backward, optimizer step); per token: step / tokens per step
over all ranks. Memory: peak USS over the run, summed over the node's processes (USS adds up across processes),
sampled every 0.05 s for the peers and 0.1 s for ours (big_model's default), as a user's processes hold it (no
allocator variables). Writes ``<out>/peer_qlora.json`` and ``<out>/peer_qlora.md``; the ``big_model/run.py`` records
of our runs go to ``<out>/peer_qlora_ours.json``.

Steadiness (issue 53): ``--rounds N`` runs the configurations N times over, and the report's second table
(``harness/steadiness.py``) gives every timed step of every round, the spread (slowest ÷ fastest), and the median ÷
the same round's dense floor and QLoRA peer. Each step is followed, outside its time, by fixed work (``MachineCanary``:
a 4 MiB copy and a 512^3 matmul on one thread and on both, 8 times each): a step slow while the canary is not points
at the process, both slow at the machine; its ``threads_worth`` (the two-thread matmul ÷ the one-thread one) near 1
instead of 2 says the two vCPUs share one core. ``--canary none small large`` runs the kinds after successive steps in
turn, and the report adds each run's median step after each kind: what a canary costs the step after it, side by side
in one process. Ours also records each thread's CPU seconds in every step, when its forward, backward and optimizer
step ended, and the seconds from the last step's end to ``fit``'s return (``peer_qlora_ours.json``). Goals: spread ≤
1.15; ours' median ≤ 1.05x the floor and ≤ the peer.

The big-model study is run through its command line (``run`` and ``write``), not imported.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from benchmarks.harness import launch, plain_loop, steadiness  # noqa: E402
from benchmarks.harness.probes import add_canary_option, cpu_model, load_average, machine  # noqa: E402
from benchmarks.harness.records import now_utc, read_json, write_json  # noqa: E402

BIG_MODEL = HERE.parent / "big_model" / "run.py"

SIZE = "1.1b"
SEQUENCE = 64
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
OURS = (("ours NF4 1r", "nf4", 1), ("ours NF4 2r", "nf4", 2), ("ours bf16 1r", "bf16", 1))
PEERS = (("peer dense", False), ("peer QLoRA", True))
# issue 24's goals: our step per token no slower than the QLoRA peer's; our peak memory <= 0.5x the peer's
GOAL_STEP, GOAL_MEMORY = 1.0, 0.5


def run_peer(name: str, nf4: bool, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    spec = dict(folder=str(folder), lora=LORA, nf4=nf4, sequence=SEQUENCE, warmup=args.warmup, steps=args.steps)
    spec["canary"] = args.canary
    return plain_loop.run(name, spec, args.timeout)


def run_ours(name: str, frozen_dtype: str, devices: int, args: argparse.Namespace) -> dict[str, Any]:
    records = args.out / "peer_qlora_ours.json"
    command = [
        sys.executable,
        str(BIG_MODEL),
        "run",
        "--size",
        SIZE,
        "--frozen-dtype",
        frozen_dtype,
        "--precision",
        "32-true",
        "--devices",
        str(devices),
        "--sequence",
        str(SEQUENCE),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--no-resume",
        "--data-dir",
        str(args.data_dir),
        "--out",
        str(args.out / "peer_qlora_ours"),
        "--canary",
        *args.canary,
    ]
    print(f"\n=== {name}", flush=True)
    # big_model's driver guards its own processes (timeout, memory) and records why it stopped one
    subprocess.run([*command, "--timeout-min", str(args.timeout * devices / 60)], env=launch.child_env())
    found = read_json(args.out / "peer_qlora_ours" / "big_model.json")["records"][-1]
    merged = read_json(records) if records.exists() else []
    write_json(records, [*merged, found])
    summary = found["summary"]
    if summary["status"] != "ok":
        return {"name": name, "status": summary["status"], "reason": summary.get("reason")}
    rank0 = next(r for r in found["ranks"] if r["rank"] == 0)
    return {
        "name": name,
        "status": "ok",
        "ranks": devices,
        "tokens_per_step": SEQUENCE * devices,
        "units_per_step": SEQUENCE * devices,
        "step_s": summary["step_s"],
        "peak_uss": summary["train_peak_uss"],
        "load_s": summary.get("first_step_at_s"),
        # rank 0's every step (warm-up first), what each thread used in it and the machine's copy rate after it
        "steps_s": rank0.get("step_s", []),
        "step_threads": rank0.get("step_threads", []),
        "canary": rank0.get("canary", []),
        "step_phases": rank0.get("step_phases", []),
        "after_last_step": rank0.get("after_last_step", {}),
    }


def write_folder(data_dir: Path) -> Path:
    """The folder big_model's ``write`` makes (or reuses) for this size, under ``data_dir``."""
    subprocess.run(
        [sys.executable, str(BIG_MODEL), "write", "--size", SIZE, "--data-dir", str(data_dir)],
        check=True,
        env=launch.child_env(),
    )
    return data_dir / f"llama-{SIZE}"


def report(result: dict[str, Any]) -> str:
    rows = {r["name"]: r for r in result["rows"]}
    peer = rows.get("peer QLoRA", {})
    lines = [
        "# LoRA on a TinyLlama-1.1B-shaped base: the CPU peer and `frozen_deepspeed`, side by side",
        "",
        f"Written by `benchmarks/peer_qlora/run.py` on {result['date']} ({result['machine']}; load average"
        f" {result['load_before']} before, {result['load_after']} after). {SEQUENCE} tokens per sequence, one per"
        " rank and step, fp32 compute, LoRA r=8 on q/v, AdamW. Ratios are to the QLoRA peer (transformers +"
        " bitsandbytes NF4 + PEFT).",
        "",
        "| run | ranks | median step s | s per token | ÷ peer QLoRA | peak USS GiB (node) | ÷ peer QLoRA |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row["status"] != "ok":
            lines.append(f"| {row['name']} | | {row['status']} {row.get('reason') or ''} | | | | |")
            continue
        per_token = row["step_s"] / row["tokens_per_step"]
        ratio_t = per_token / (peer["step_s"] / peer["tokens_per_step"]) if peer.get("status") == "ok" else None
        ratio_m = row["peak_uss"] / peer["peak_uss"] if peer.get("status") == "ok" else None
        lines.append(
            f"| {row['name']} | {row['ranks']} | {row['step_s']:.2f} | {per_token:.3f} |"
            f" {'' if ratio_t is None else f'{ratio_t:.2f}'} | {row['peak_uss'] / 2**30:.2f} |"
            f" {'' if ratio_m is None else f'{ratio_m:.2f}'} |"
        )
    lines += ["", f"Goals (issue 24): ours per token ≤ {GOAL_STEP}x the QLoRA peer; peak memory ≤ {GOAL_MEMORY}x.", ""]
    lines += ["## Every step, round by round", ""]
    return "\n".join(lines + steadiness.round_lines(result["rounds"], "peer dense", "peer QLoRA")) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="run the configurations this many times over")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    parser.add_argument("--only", nargs="+", help="run only these names (e.g. 'peer QLoRA' 'ours NF4 1r')")
    add_canary_option(parser)
    parser.add_argument("--data-dir", type=Path, default=Path("/work/bench-data"))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    folder = write_folder(args.data_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = load_average()[0]
    rounds = []
    for _ in range(args.rounds):
        rows = []
        for name, nf4 in PEERS:
            if not args.only or name in args.only:
                rows.append(dict(run_peer(name, nf4, folder, args), timed=args.steps))
        for name, frozen_dtype, devices in OURS:
            if not args.only or name in args.only:
                rows.append(dict(run_ours(name, frozen_dtype, devices, args), timed=args.steps))
        rounds.append(rows)
    result = {
        "date": now_utc(),
        "load_before": load_before,
        "load_after": load_average()[0],
        "machine": f"{cpu_model()}, {machine()}",
        "rows": rounds[0],
        "rounds": rounds,
    }
    write_json(args.out / "peer_qlora.json", result)
    (args.out / "peer_qlora.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
