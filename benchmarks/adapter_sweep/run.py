"""K LoRA adapters trained at once on one frozen base against K separate runs.

    python benchmarks/adapter_sweep/run.py [--task minilm|causal] [--ks 1 2 4 8] [--devices 1] [--steps 8] [--out DIR]
    python benchmarks/adapter_sweep/run.py --task causal --checkpointing   # with Hugging Face's gradient checkpointing

Two tasks:
- ``minilm``: ``examples/adapter_sweep/task.py``'s ``SentimentSweep`` (all-MiniLM-L6-v2, LoRA on query/value and
  the head), batches of 16 sentences;
- ``causal``: ``causal.py``'s ``CausalSweep``, LoRA on q/v of a TinyLlama-1.1B-shaped folder (written once by
  ``benchmarks/big_model/run.py write --size 1.1b``, as ``peer_qlora`` uses it) loaded in ``configure_model`` and
  stored as ``--frozen-dtype`` (NF4 by default), one sequence of 64 random tokens per adapter and step.

For each K, a fresh process (a process pair with ``--devices 2``; Lightning's launcher re-runs this script for the
other rank) trains the task with K adapters (ranks 4 and 8, learning rates apart) for ``--steps`` steps on the same
batches, in fp32, 1 torch thread per rank. Each rank reports:

- **wall time**: from the start of the worker (imports, the base's load, DeepSpeed's setup, the fingerprint) to the
  end of ``fit``: what a run costs;
- **step time**: median wall time of the steps after the first 2; **time per sample per adapter** is that over
  batch size x K;
- **host peak**: the rank's RSS high-water mark (``VmHWM``); the node's is the sum over its ranks; the **training
  peak** is the same from the start of training on (the mark is reset there: ``probes.reset_peak_rss``), without the
  base's load;
- **gathered bytes per step**: the output bytes of every ZeRO-3 all-gather during a step.

K separate runs are K times the K = 1 run (same base, same steps, other hyper-parameters), one after another: their
wall time adds up and their host peak is one run's; run side by side, their host peaks add up instead. Writes
``<out>/adapter_sweep.json`` and ``<out>/adapter_sweep.md`` (``minilm``), ``<out>/adapter_sweep_causal.*``
(``causal``), with the load average before and after: timings are only as good as the machine was quiet.

``--checkpointing`` (causal task) turns on the model's gradient checkpointing (``gradient_checkpointing_enable()``):
each decoder layer keeps only its input for the backward and runs its forward again there, so the activations that
grow with K shrink to one layer's, at the price of a second forward. Results go to
``adapter_sweep_causal_checkpointed.*``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STARTED = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import launch, plain_loop, steadiness  # noqa: E402
from benchmarks.harness.probes import cpu_model, load_average, proc_status_bytes, reset_peak_rss  # noqa: E402
from benchmarks.harness.records import RankReport, now_utc, read_rank_reports, write_json  # noqa: E402

SKIPPED_STEPS = 2
BATCH_SIZE = {"minilm": 16, "causal": 1}  # rows per adapter, rank and step
TOKENS = 64  # per sequence of the causal task, as peer_qlora's
TIMEOUT_MIN = 60  # per K
BIG_MODEL = Path(__file__).resolve().parents[1] / "big_model" / "run.py"
CAUSAL_SIZE = "1.1b"
PEER_LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)  # as peer_qlora's
TITLES = {
    "minilm": "MiniLM sweep task",
    "causal": f"LoRA q/v on a TinyLlama-{CAUSAL_SIZE.upper()}-shaped causal LM, {TOKENS} tokens per sequence",
}


def adapter_specs(k: int) -> dict[str, dict[str, float]]:
    """K adapters of a small sweep: ranks 4 and 8 in turn, learning rates 1e-3 to 3e-3."""
    return {
        f"k{i}": {"rank": 4 if i % 2 == 0 else 8, "alpha": 16, "lr": 1e-3 * (1 + 2 * i / max(1, k - 1))}
        | {"weight_decay": 0.01, "warmup_steps": 2}
        for i in range(k)
    }


def worker(k: int, args: argparse.Namespace, run_dir: Path) -> None:
    import lightning as L
    import torch

    from benchmarks.harness.callbacks import StepMeter
    from lightning_frozen import FrozenAwareDeepSpeedStrategy

    torch.set_num_threads(args.threads)
    L.seed_everything(0)
    measure, peaks = StepMeter(), _training_peak_callback()()
    if args.task == "causal":
        from benchmarks.adapter_sweep.causal import CausalSweep, token_batches

        model: L.LightningModule = CausalSweep(str(args.folder), adapter_specs(k), checkpointing=args.checkpointing)
        data: object = token_batches(32000, TOKENS, args.steps, BATCH_SIZE["causal"])
        strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype=None if args.frozen_dtype == "none" else args.frozen_dtype)
    else:
        from examples.adapter_sweep.task import SentimentSweep
        from examples.minilm_lora.task import SentimentData

        model = SentimentSweep(adapter_specs(k))
        model.configure_callbacks = list  # no per-adapter ModelCheckpoint: nothing is saved here
        data = SentimentData(batch_size=BATCH_SIZE["minilm"])
        strategy = FrozenAwareDeepSpeedStrategy()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        precision="32-true",
        max_epochs=1,
        limit_train_batches=args.steps,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[measure, peaks],
    )
    trainer.fit(model, data)
    RankReport(run_dir).update(
        k=k,
        world_size=trainer.world_size,
        wall_seconds=time.monotonic() - STARTED,
        step_seconds_median=statistics.median(measure.step_seconds[SKIPPED_STEPS:]),
        steps_s=measure.step_seconds,
        gathered_bytes_per_step=statistics.median(measure.step_bytes[SKIPPED_STEPS:]),
        host_peak_bytes=max(peaks.before_training, proc_status_bytes("VmHWM")),
        train_peak_bytes=proc_status_bytes("VmHWM"),
    )


def steadiness_rounds(ks: list[int], runs: dict[int, list[dict[str, Any]]], args: argparse.Namespace) -> list:
    """One round per K: rank 0's every step of the K-adapter run; with ``--peers``, for K > 1, beside it the dense
    floor and the QLoRA peer (``harness/plain_loop.py``, one LoRA r=8 on q/v) on K sequences a step, the same
    tokens per step, warm-up and threads."""
    rounds = []
    for k in ks:
        rank0 = next(run for run in runs[k] if run["rank"] == 0)
        units = BATCH_SIZE[args.task] * k * rank0["world_size"] * (TOKENS if args.task == "causal" else 1)
        ours = {"name": f"ours K={k}", "status": "ok", "steps_s": rank0["steps_s"], "units_per_step": units}
        rows = [dict(ours, timed=args.steps - SKIPPED_STEPS)]
        if args.peers and k > 1:
            for name, nf4 in (("peer dense", False), ("peer QLoRA", True)):
                spec = dict(folder=str(args.folder), lora=PEER_LORA, nf4=nf4, sequence=TOKENS, batch=k * args.devices)
                spec.update(warmup=SKIPPED_STEPS, steps=args.steps - SKIPPED_STEPS, threads=args.threads * args.devices)
                rows.append(dict(plain_loop.run(name, spec, TIMEOUT_MIN * 60), timed=args.steps - SKIPPED_STEPS))
        rounds.append(rows)
    return rounds


def _steadiness_lines(rounds: list, args: argparse.Namespace, machine: dict[str, Any]) -> list[str]:
    unit = "token" if args.task == "causal" else "row"
    return [
        "## Every step (issue 53's steadiness check)",
        "",
        f"{machine['cpu']}; load average {machine['load_before'][0]} before the sweep,"
        f" {machine['load_after'][0]} after it, {machine['load_after_peers'][0]} after the peers. One round per K:"
        f" ours with K adapters, {args.threads} torch thread(s) per rank; for K > 1 (`--peers`) the dense floor and"
        " the QLoRA peer in a plain loop on K sequences a step (one LoRA r=8 on q/v), on as many threads in all. The"
        f" first {SKIPPED_STEPS} steps are warm-up.",
        "",
        *steadiness.round_lines(rounds, "peer dense", "peer QLoRA", unit),
    ]


def _training_peak_callback() -> type:
    from lightning.pytorch.callbacks import Callback

    class TrainingPeak(Callback):
        """Keeps the RSS high-water mark reached before training and resets it, so that ``VmHWM`` at the end is the
        training's own peak."""

        before_training = 0

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.before_training = proc_status_bytes("VmHWM")
            reset_peak_rss()

    return TrainingPeak


def _row(k: int, runs: list[dict[str, Any]], alone: dict[str, float], batch_size: int) -> dict[str, float]:
    wall = max(run["wall_seconds"] for run in runs)
    step = max(run["step_seconds_median"] for run in runs)
    peak = sum(run["host_peak_bytes"] for run in runs)
    return {
        "k": k,
        "wall_seconds": wall,
        "separate_wall_seconds": k * alone["wall_seconds"],
        "step_seconds": step,
        "seconds_per_sample_per_adapter": step / (batch_size * runs[0]["world_size"] * k),
        "node_host_peak_bytes": peak,
        "node_train_peak_bytes": sum(run.get("train_peak_bytes", 0) for run in runs),
        "separate_node_host_peak_bytes_side_by_side": k * alone["node_host_peak_bytes"],
        "gathered_bytes_per_adapter_step": runs[0]["gathered_bytes_per_step"] / k,
    }


def _markdown(rows: list[dict[str, float]], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    alone = rows[0]
    storage = f", base stored as {args.frozen_dtype}" if args.task == "causal" else ""
    storage += ", gradient checkpointing" if args.checkpointing else ""
    lines = [
        f"# K adapters at once vs K separate runs ({TITLES[args.task]}{storage}, {args.devices} CPU rank(s),"
        f" {args.steps} steps, fp32)",
        "",
        f"Written by `benchmarks/adapter_sweep/run.py --task {args.task}` on {machine['date']} (2 CPU cores; load"
        f" average {machine['load_before'][0]} before, {machine['load_after'][0]} after). K separate runs: K times the"
        " K = 1 run, one after another (their wall times add up) or side by side (their host peaks add up). Goals"
        " (issue 24): K = 4 at ≥ 2.5x the throughput of 4 separate runs, with ≤ 1.2x the host peak of one.",
        "",
        "| K | wall, one run | wall, K runs in a row | speed-up | step | per sample per adapter | node host peak"
        " | K runs side by side | node training peak | gathered per adapter-step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['k']} | {row['wall_seconds']:.1f} s | {row['separate_wall_seconds']:.1f} s"
            f" | {row['separate_wall_seconds'] / row['wall_seconds']:.2f}x | {row['step_seconds']:.3f} s"
            f" | {row['seconds_per_sample_per_adapter'] * 1e3:.2f} ms"
            f" | {row['node_host_peak_bytes'] / 2**20:.0f} MiB"
            f" ({row['node_host_peak_bytes'] / alone['node_host_peak_bytes']:.2f}x of K=1)"
            f" | {row['separate_node_host_peak_bytes_side_by_side'] / 2**20:.0f} MiB"
            f" | {row['node_train_peak_bytes'] / 2**20:.0f} MiB"
            f" ({row['node_train_peak_bytes'] / alone['node_train_peak_bytes']:.2f}x)"
            f" | {row['gathered_bytes_per_adapter_step'] / 2**20:.1f} MiB |"
        )
    return "\n".join(lines + _split_lines(rows)) + "\n"


def _split_lines(rows: list[dict[str, float]]) -> list[str]:
    """What the measured K say about a step and a peak: the part the adapters share (the base's gathers and decodes,
    the process) and the part each adapter adds (its rows' matmuls and activations), fitted as ``shared + K x each``
    by least squares over every K, and what the goals would need of that split."""
    if len(rows) < 2:
        return []
    ks = [row["k"] for row in rows]
    step_each, step_shared = statistics.linear_regression(ks, [row["step_seconds"] for row in rows])
    peak_each, peak_shared = statistics.linear_regression(ks, [row["node_host_peak_bytes"] for row in rows])
    step_1, peak_1 = step_shared + step_each, peak_shared + peak_each
    fitted = ", ".join(
        f"K = {row['k']}: {step_shared + row['k'] * step_each:.2f} s (measured {row['step_seconds']:.2f} s)"
        for row in rows
    )
    return [
        "",
        "## What the goals ask of a step",
        "",
        f"Fitted over K = {', '.join(str(row['k']) for row in rows)} as shared + K x each (least squares): a step is"
        f" {step_shared:.2f} s shared by the adapters and {step_each:.2f} s per adapter ({fitted}); the host peak"
        f" is {peak_shared / 2**20:.0f} MiB shared and {peak_each / 2**20:.0f} MiB per adapter.",
        "- 2.5x the steps of 4 runs needs the shared part to be at least 80% of a K = 1 step (4(M + S) ≥ 2.5(4M + S)"
        " means S ≥ 4M); 1.2x the peak of one needs each adapter to add at most 6.7% of it (1 + 3a ≤ 1.2).",
        f"- Here the shared part is {step_shared / step_1:.0%} of the fitted K = 1 step, which would allow"
        f" {4 * step_1 / (step_shared + 4 * step_each):.2f}x at K = 4, and each adapter adds"
        f" {peak_each / peak_1:.0%} of the fitted K = 1 peak: each adapter's own rows (their matmuls through every"
        " layer, and the activations kept for the backward) grow with K, and with the base decoded near memory speed"
        " and held as NF4 the base no longer dominates either.",
        *_training_split(rows),
    ]


def _training_split(rows: list[dict[str, float]]) -> list[str]:
    """The same split of the training peak alone, where the runs recorded it."""
    if not all(row.get("node_train_peak_bytes") for row in rows):
        return []
    ks = [row["k"] for row in rows]
    each, shared = statistics.linear_regression(ks, [row["node_train_peak_bytes"] for row in rows])
    return [
        f"- The training peak alone (the base's load left out) is {shared / 2**20:.0f} MiB shared and"
        f" {each / 2**20:.0f} MiB per adapter: each adapter adds {each / (shared + each):.0%} of the fitted K = 1"
        " training peak."
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TITLES), default="minilm")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help=f"more than {SKIPPED_STEPS}: the first are not timed")
    parser.add_argument("--frozen-dtype", choices=["none", "bf16", "int8", "nf4"], default="nf4", help="causal task")
    parser.add_argument("--data-dir", type=Path, default=Path("/work/bench-data"), help="causal task: its folder")
    parser.add_argument("--checkpointing", action="store_true", help="causal task: gradient checkpointing on")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (and per peer)")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="causal task: for each K > 1, the dense floor and the QLoRA peer on K sequences a step, and every step",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.folder = args.data_dir / f"llama-{CAUSAL_SIZE}"  # what big_model's ``write`` makes (or reuses)
    if (args.checkpointing or args.peers) and args.task != "causal":
        parser.error("--checkpointing and --peers are for --task causal")
    stem = "adapter_sweep" if args.task == "minilm" else f"adapter_sweep_{args.task}"
    stem += "_checkpointed" if args.checkpointing else ""
    raw = args.out / f"{stem}_runs"
    if args.worker is not None:
        worker(args.worker, args, raw / f"k{args.worker}")
        return
    if args.task == "causal":
        write = [sys.executable, str(BIG_MODEL), "write", "--size", CAUSAL_SIZE, "--data-dir", str(args.data_dir)]
        subprocess.run(write, check=True)
    machine = {"date": now_utc(), "load_before": load_average(), "cpu": cpu_model()}
    ks = sorted(set(args.ks) | {1})
    runs = {}
    for k in ks:
        command = [sys.executable, __file__, "--worker", str(k), "--devices", str(args.devices), "--task", args.task]
        command += ["--steps", str(args.steps), "--out", str(args.out), "--frozen-dtype", args.frozen_dtype]
        command += ["--threads", str(args.threads)]
        command += ["--data-dir", str(args.data_dir), *(["--checkpointing"] if args.checkpointing else [])]
        shutil.rmtree(raw / f"k{k}", ignore_errors=True)
        log = raw / f"k{k}" / "worker.log"
        outcome = launch.guarded_run(command, launch.child_env(), log, TIMEOUT_MIN, reports_dir=raw / f"k{k}")
        runs[k] = read_rank_reports(raw / f"k{k}")
        if launch.exit_status(outcome) != 0 or len(runs[k]) != args.devices:
            reason = outcome.get("reason") or f"exit {outcome['returncode']}"
            raise SystemExit(f"K={k} failed ({reason}):\n{log.read_text()[-5000:]}")
    machine["load_after"] = load_average()
    alone = runs[1]
    alone_summary = {
        "wall_seconds": max(run["wall_seconds"] for run in alone),
        "node_host_peak_bytes": sum(run["host_peak_bytes"] for run in alone),
    }
    rows = [_row(k, runs[k], alone_summary, BATCH_SIZE[args.task]) for k in ks]
    rounds = steadiness_rounds(ks, runs, args)
    machine["load_after_peers"] = load_average()
    markdown = _markdown(rows, args, machine) + "\n".join(["", *_steadiness_lines(rounds, args, machine)])
    write_json(args.out / f"{stem}.json", {"machine": machine, "rows": rows, "runs": runs, "rounds": rounds})
    (args.out / f"{stem}.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
