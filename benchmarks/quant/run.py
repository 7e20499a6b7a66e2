"""The frozen base stored in bf16, int8 and NF4 (``frozen_dtype``), side by side on the MiniLM LoRA example task.

    python benchmarks/quant/run.py [--devices 2] [--epochs 3] [--rounds 3] [--out benchmarks/quant/results]
    python benchmarks/quant/run.py --accelerator gpu --devices 1 --out benchmarks/quant/results/gpu   # on CUDA

For each storage, a fresh process pair (Lightning's launcher re-runs this script for rank 1) fine-tunes the
example's LoRA adapter on all-MiniLM-L6-v2 (``examples/minilm_lora/task.py``) in ``bf16-true`` with the same seed,
so only how the frozen base is stored differs, then validates. Each rank reports:

- **host bytes of the frozen base**: the bytes of its frozen ZeRO-3 shards (codes and scales when quantized);
- **bytes gathered per step**: the output bytes of every all-gather ZeRO-3 and the quantized gather issue during
  the training steps (what crosses PCIe or the network), per step;
- **step time**: median wall time of the training steps after the first epoch's first 3 (CPU, 1 torch thread per
  rank): the dequantization cost on the CPU shows against bf16. With ``--rounds N`` the storages run in turn N
  times (bf16, int8, NF4, bf16, ...), so that a shared machine's load falls on all of them alike; each round's
  step times are reported, and the table takes the median over rounds;
- **quality**: validation accuracy and loss after training, and the training loss of the last epoch;
- **memory**: each rank's RSS high-water mark up to ``on_train_start`` (model build, partitioning, quantizing) and
  its RSS after fit (``/proc/self/status``, Linux). The example builds MiniLM in ``__init__``, so every rank holds
  the whole fp32 model before ZeRO-3 shards it; quantizing must add nothing to that peak.

On CUDA (``--accelerator gpu``) the frozen shards are in pinned host memory and each gather copies codes to the
GPU; the worker takes the default torch threads. Writes ``<out>/quant.json`` and ``<out>/quant.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.probes import proc_status_bytes  # noqa: E402
from benchmarks.harness.records import RankReport, read_rank_reports, write_json  # noqa: E402

STORAGES = ("bf16", "int8", "nf4")
SKIPPED_STEPS = 3
TIMEOUT_MIN = 60  # per storage and round


def worker(storage: str, devices: int, epochs: int, run_dir: Path, accelerator: str = "cpu") -> None:
    import lightning as L
    import torch

    from benchmarks.harness.callbacks import StepMeter
    from examples.minilm_lora.task import LoRASentimentClassifier, SentimentData
    from lightning_frozen import FrozenAwareDeepSpeedStrategy

    if accelerator == "cpu":
        torch.set_num_threads(1)

    class Measure(StepMeter):
        def __init__(self) -> None:
            super().__init__()
            self.train_losses: list[float] = []
            self.setup_peak_rss = 0

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.setup_peak_rss = proc_status_bytes("VmHWM")

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            if trainer.current_epoch == trainer.max_epochs - 1:
                self.train_losses.append(float(outputs["loss"]))

    L.seed_everything(0)
    model = LoRASentimentClassifier()
    data = SentimentData()
    measure = Measure()
    strategy = FrozenAwareDeepSpeedStrategy(
        frozen_dtype=None if storage == "bf16" else storage, pin_memory=accelerator == "gpu"
    )
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision="bf16-true",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[measure],
    )
    trainer.fit(model, data)
    rss_after_fit = proc_status_bytes("VmRSS")
    metrics = trainer.validate(model, data, verbose=False)[0]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    RankReport(run_dir).update(
        storage=storage,
        world_size=trainer.world_size,
        frozen_params=sum(int(p.ds_numel) for p in frozen),
        frozen_host_bytes=sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in frozen),
        steps=len(measure.step_seconds),
        gathered_bytes_per_step=statistics.median(measure.step_bytes[SKIPPED_STEPS:]),
        step_seconds_median=statistics.median(measure.step_seconds[SKIPPED_STEPS:]),
        setup_peak_rss=measure.setup_peak_rss,
        rss_after_fit=rss_after_fit,
        val_acc=float(metrics["val_acc"]),
        val_loss=float(metrics["val_loss"]),
        last_epoch_train_loss=statistics.mean(measure.train_losses),
    )


def _step(reports: list[dict[str, Any]], rounds: list[dict[str, float]], storage: str) -> float:
    """The storage's step time: its worst rank's median, or the median of that over rounds when there are several."""
    return statistics.median(r[storage] for r in rounds) if rounds else max(r["step_seconds_median"] for r in reports)


def _table(results: dict[str, list[dict[str, Any]]], rounds: list[dict[str, float]]) -> str:
    bf16 = results["bf16"]
    rows = [
        "| storage | frozen base, host bytes (all ranks) | vs bf16 | gathered per step (all ranks) | vs bf16 |"
        " step time (median, worst rank) | setup RSS peak (worst rank) | RSS after fit (worst rank) | val accuracy |"
        " val loss | train loss (last epoch) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_host = sum(r["frozen_host_bytes"] for r in bf16)
    base_gathered = sum(r["gathered_bytes_per_step"] for r in bf16)
    base_step = _step(bf16, rounds, "bf16")
    for storage, reports in results.items():
        host = sum(r["frozen_host_bytes"] for r in reports)
        gathered = sum(r["gathered_bytes_per_step"] for r in reports)
        step = _step(reports, rounds, storage)
        rows.append(
            f"| {storage} | {host / 2**20:.2f} MiB | {host / base_host:.3f}x | {gathered / 2**20:.1f} MiB |"
            f" {gathered / base_gathered if base_gathered else float('nan'):.3f}x |"
            f" {step * 1000:.0f} ms ({step / base_step:.2f}x) |"
            f" {max(r['setup_peak_rss'] for r in reports) / 2**20:.0f} MiB |"
            f" {max(r['rss_after_fit'] for r in reports) / 2**20:.0f} MiB | {reports[0]['val_acc']:.3f} |"
            f" {reports[0]['val_loss']:.4f} | {statistics.mean(r['last_epoch_train_loss'] for r in reports):.4f} |"
        )
    if len(rounds) > 1:
        rows += ["", "| round | " + " | ".join(f"{storage} step" for storage in results) + " |"]
        rows.append("|---|" + "---|" * len(results))
        for number, steps in enumerate(rounds, 1):
            cells = [f"{steps[s] * 1000:.0f} ms ({steps[s] / steps['bf16']:.2f}x)" for s in results]
            rows.append(f"| {number} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--rounds", type=int, default=1, help="run the storages in turn this many times")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--worker", choices=STORAGES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    runs = args.out / "tmp" / "quant"
    if args.worker:
        worker(args.worker, args.devices, args.epochs, runs / args.worker, args.accelerator)
        return
    results: dict[str, list[dict[str, Any]]] = {}
    rounds: list[dict[str, float]] = []
    for number in range(args.rounds):
        steps = {}
        for storage in STORAGES:
            started = time.monotonic()
            command = [sys.executable, __file__, f"--worker={storage}", f"--devices={args.devices}"]
            command += [f"--epochs={args.epochs}", f"--out={args.out}", f"--accelerator={args.accelerator}"]
            env = launch.child_env(threads=1 if args.accelerator == "cpu" else None)
            shutil.rmtree(runs / storage, ignore_errors=True)  # no report of an earlier round is read as this one's
            log = runs / storage / "worker.log"
            outcome = launch.guarded_run(command, env, log, TIMEOUT_MIN, reports_dir=runs / storage)
            results[storage] = read_rank_reports(runs / storage)
            if launch.exit_status(outcome) != 0 or len(results[storage]) != args.devices:
                reason = outcome.get("reason") or f"exit {outcome['returncode']}"
                raise SystemExit(f"{storage} failed ({reason}):\n{log.read_text()[-5000:]}")
            steps[storage] = max(r["step_seconds_median"] for r in results[storage])
            print(f"round {number + 1}, {storage}: {time.monotonic() - started:.0f} s", flush=True)
        rounds.append(steps)
    write_json(args.out / "quant.json", {**results, "rounds": rounds})
    table = _table(results, rounds)
    where = f"{args.devices} CPU ranks" if args.accelerator == "cpu" else f"{args.devices} CUDA GPU(s)"
    (args.out / "quant.md").write_text(
        f"# Frozen base storage: bf16 / int8 / NF4\n\nMiniLM LoRA example task, {where}, {args.epochs} epochs,"
        f" bf16-true, seed 0, {args.rounds} round(s), load average {list(os.getloadavg())} at the end. Written by"
        f" `benchmarks/quant/run.py`.\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
