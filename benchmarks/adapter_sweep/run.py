"""K LoRA adapters trained at once on one frozen base against K separate runs, on the MiniLM sweep example's task.

    python benchmarks/adapter_sweep/run.py [--ks 1 2 4 8] [--devices 1] [--steps 8] [--out DIR]

For each K, a fresh process (a process pair with ``--devices 2``; Lightning's launcher re-runs this script for the
other rank) trains ``examples/adapter_sweep/task.py``'s ``SentimentSweep`` with K adapters (ranks 4 and 8, learning
rates apart) for ``--steps`` steps on the same batches, in fp32, 1 torch thread per rank. Each rank reports:

- **wall time**: from the start of the worker (imports, the base's load, DeepSpeed's setup, the fingerprint) to the
  end of ``fit``: what a run costs;
- **step time**: median wall time of the steps after the first 2; **time per sample per adapter** is that over
  batch size x K;
- **host peak**: the rank's RSS high-water mark (``VmHWM``); the node's is the sum over its ranks;
- **gathered bytes per step**: the output bytes of every ZeRO-3 all-gather during a step.

K separate runs are K times the K = 1 run (same base, same steps, other hyper-parameters), one after another: their
wall time adds up and their host peak is one run's; run side by side, their host peaks add up instead. Writes
``<out>/adapter_sweep.json`` and ``<out>/adapter_sweep.md``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

STARTED = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.probes import proc_status_bytes  # noqa: E402
from benchmarks.harness.records import RankReport, read_rank_reports, write_json  # noqa: E402

SKIPPED_STEPS = 2
BATCH_SIZE = 16
TIMEOUT_MIN = 60  # per K


def adapter_specs(k: int) -> dict[str, dict[str, float]]:
    """K adapters of a small sweep: ranks 4 and 8 in turn, learning rates 1e-3 to 3e-3."""
    return {
        f"k{i}": {"rank": 4 if i % 2 == 0 else 8, "alpha": 16, "lr": 1e-3 * (1 + 2 * i / max(1, k - 1))}
        | {"weight_decay": 0.01, "warmup_steps": 2}
        for i in range(k)
    }


def worker(k: int, devices: int, steps: int, run_dir: Path) -> None:
    import lightning as L
    import torch

    from benchmarks.harness.callbacks import StepMeter
    from examples.adapter_sweep.task import SentimentSweep
    from examples.minilm_lora.task import SentimentData

    torch.set_num_threads(1)
    L.seed_everything(0)
    measure = StepMeter()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="frozen_deepspeed",
        precision="32-true",
        max_epochs=1,
        limit_train_batches=steps,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[measure],
    )
    model = SentimentSweep(adapter_specs(k))
    model.configure_callbacks = list  # no per-adapter ModelCheckpoint: nothing is saved here
    trainer.fit(model, SentimentData(batch_size=BATCH_SIZE))
    RankReport(run_dir).update(
        k=k,
        world_size=trainer.world_size,
        wall_seconds=time.monotonic() - STARTED,
        step_seconds_median=statistics.median(measure.step_seconds[SKIPPED_STEPS:]),
        gathered_bytes_per_step=statistics.median(measure.step_bytes[SKIPPED_STEPS:]),
        host_peak_bytes=proc_status_bytes("VmHWM"),
    )


def _row(k: int, runs: list[dict[str, Any]], alone: dict[str, float]) -> dict[str, float]:
    wall = max(run["wall_seconds"] for run in runs)
    step = max(run["step_seconds_median"] for run in runs)
    peak = sum(run["host_peak_bytes"] for run in runs)
    return {
        "k": k,
        "wall_seconds": wall,
        "separate_wall_seconds": k * alone["wall_seconds"],
        "step_seconds": step,
        "seconds_per_sample_per_adapter": step / (BATCH_SIZE * runs[0]["world_size"] * k),
        "node_host_peak_bytes": peak,
        "separate_node_host_peak_bytes_side_by_side": k * alone["node_host_peak_bytes"],
        "gathered_bytes_per_adapter_step": runs[0]["gathered_bytes_per_step"] / k,
    }


def _markdown(rows: list[dict[str, float]], devices: int, steps: int) -> str:
    alone = rows[0]
    lines = [
        f"# K adapters at once vs K separate runs (MiniLM sweep task, {devices} CPU rank(s), {steps} steps, fp32)",
        "",
        "Measured on a shared 2-core machine (other jobs ran at the same time): timings are indicative only.",
        "",
        "| K | wall, one run | wall, K runs in a row | speed-up | step | per sample per adapter | node host peak"
        " | K runs side by side | gathered per adapter-step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['k']} | {row['wall_seconds']:.1f} s | {row['separate_wall_seconds']:.1f} s"
            f" | {row['separate_wall_seconds'] / row['wall_seconds']:.2f}x | {row['step_seconds']:.3f} s"
            f" | {row['seconds_per_sample_per_adapter'] * 1e3:.2f} ms"
            f" | {row['node_host_peak_bytes'] / 2**20:.0f} MiB"
            f" ({row['node_host_peak_bytes'] / alone['node_host_peak_bytes']:.2f}x of K=1)"
            f" | {row['separate_node_host_peak_bytes_side_by_side'] / 2**20:.0f} MiB"
            f" | {row['gathered_bytes_per_adapter_step'] / 2**20:.1f} MiB |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help=f"more than {SKIPPED_STEPS}: the first are not timed")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    raw = args.out / "adapter_sweep_runs"
    if args.worker is not None:
        worker(args.worker, args.devices, args.steps, raw / f"k{args.worker}")
        return
    ks = sorted(set(args.ks) | {1})
    runs = {}
    for k in ks:
        command = [sys.executable, __file__, "--worker", str(k), "--devices", str(args.devices)]
        command += ["--steps", str(args.steps), "--out", str(args.out)]
        shutil.rmtree(raw / f"k{k}", ignore_errors=True)
        log = raw / f"k{k}" / "worker.log"
        outcome = launch.guarded_run(command, launch.child_env(), log, TIMEOUT_MIN, reports_dir=raw / f"k{k}")
        runs[k] = read_rank_reports(raw / f"k{k}")
        if launch.exit_status(outcome) != 0 or len(runs[k]) != args.devices:
            reason = outcome.get("reason") or f"exit {outcome['returncode']}"
            raise SystemExit(f"K={k} failed ({reason}):\n{log.read_text()[-5000:]}")
    alone = runs[1]
    alone_summary = {
        "wall_seconds": max(run["wall_seconds"] for run in alone),
        "node_host_peak_bytes": sum(run["host_peak_bytes"] for run in alone),
    }
    rows = [_row(k, runs[k], alone_summary) for k in ks]
    write_json(args.out / "adapter_sweep.json", {"rows": rows, "runs": runs})
    (args.out / "adapter_sweep.md").write_text(_markdown(rows, args.devices, args.steps))
    print(_markdown(rows, args.devices, args.steps))


if __name__ == "__main__":
    main()
