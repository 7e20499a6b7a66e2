"""Soak: CPU ranks train for a few hundred steps with a checkpoint every few steps; is resident memory flat?

    python benchmarks/soak/run.py                                       # 2 ranks, 1000 steps, a save every 10: ~2 min
    python tests/scripts/soak.py --steps 120 --every 1 --out x.json     # what tests/test_reliability.py runs

Lightning's launcher re-runs the command for rank 1. Each rank reads its resident set size (``/proc/self/statm``)
at the start of every step, so after the previous step and its checkpoint save, if any. ``ModelCheckpoint`` keeps
the best two files and ``last.ckpt``, so files are written and removed all run long. After a warm-up (the first
quarter of the steps) the summary gives RSS growth per step (fitted over all steps, and over the last quarter
alone: a creep that settles is the allocator, a leak keeps its rate) and the mean change over a step with a
save and one without. Rank 0 prints the summary and writes every sample to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks on two cores: one thread each
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402

WIDTH, DEPTH, RANK = 256, 4, 16
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


class ResidentMemory(Callback):
    """``(global step, RSS bytes)`` at the start of every training step."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.samples.append((trainer.global_step, resident_bytes()))


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``y`` over ``x``."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def summarize(samples: list[tuple[int, int]], every: int, warmup: int) -> dict[str, Any]:
    """RSS after warm-up and at the end (MiB, medians of 10 samples) and its growth (KiB) after warm-up: per step
    (a line fitted through all samples, and through the last quarter alone, to tell a creep that settles from a
    leak), and the mean change over a step that saved a checkpoint and over one that did not.

    The sample at step ``s`` is taken after step ``s`` and, when ``s`` is a multiple of ``every``, its save.
    """
    after = [(step, rss) for step, rss in samples if step >= warmup]
    last_quarter = after[len(after) * 3 // 4 :]
    changes = [(step, rss - previous) for (_, previous), (step, rss) in zip(after, after[1:])]
    with_save = [change for step, change in changes if step % every == 0]
    without_save = [change for step, change in changes if step % every != 0]
    mib, kib = 1024**2, 1024

    def median(values: list[int]) -> float:
        return sorted(values)[len(values) // 2] / mib

    def mean(values: list[int]) -> Optional[float]:
        return sum(values) / len(values) / kib if values else None

    return {
        "rss_warm_mib": median([rss for _, rss in after[:10]]),
        "rss_end_mib": median([rss for _, rss in after[-10:]]),
        "rss_max_mib": max(rss for _, rss in after) / mib,
        "per_step_kib": _slope([(float(s), float(r)) for s, r in after]) / kib,
        "last_quarter_per_step_kib": _slope([(float(s), float(r)) for s, r in last_quarter]) / kib,
        "step_with_save_kib": mean(with_save),
        "step_without_save_kib": mean(without_save),
        "steps_measured": len(after),
        "saves_measured": len(with_save),
    }


def main(default_out: Optional[Path] = None) -> None:
    """Run the soak with the command line's settings; ``--out`` is required unless ``default_out`` is given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=10, help="save a checkpoint every N steps")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", default=default_out and str(default_out), required=default_out is None)
    args = parser.parse_args()
    warmup = args.steps // 4

    memory = ResidentMemory()
    with tempfile.TemporaryDirectory(prefix="lightning-frozen-soak-") as folder:
        saves = ModelCheckpoint(
            dirpath=folder, monitor="train_loss", save_top_k=2, save_last=True, every_n_train_steps=args.every
        )
        trainer = cpu_trainer(
            FrozenAwareDeepSpeedStrategy(),
            devices=args.devices,
            max_steps=args.steps,
            max_epochs=-1,
            callbacks=[memory, saves],
            enable_checkpointing=True,
        )
        trainer.fit(AdapterModel(width=WIDTH, depth=DEPTH, rank=RANK), regression_data(width=WIDTH, samples=64))
    gathered: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, memory.samples)
    if not trainer.is_global_zero:
        return
    per_rank = {rank: summarize(samples, args.every, warmup) for rank, samples in enumerate(gathered)}
    result = {
        "config": {
            **vars(args),
            "warmup_steps": warmup,
            "model": f"AdapterModel(width={WIDTH}, depth={DEPTH}, rank={RANK})",
        },
        "summary": per_rank,
        "samples": dict(enumerate(gathered)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for rank, summary in per_rank.items():
        without = summary["step_without_save_kib"]
        print(
            f"rank {rank}: RSS {summary['rss_warm_mib']:.1f} MiB after warm-up (step {warmup}),"
            f" {summary['rss_end_mib']:.1f} MiB at step {args.steps} (max {summary['rss_max_mib']:.1f});"
            f" {summary['per_step_kib']:+.2f} KiB/step over {summary['steps_measured']} steps,"
            f" {summary['last_quarter_per_step_kib']:+.2f} KiB/step over the last quarter;"
            f" a step with a save {summary['step_with_save_kib']:+.1f} KiB ({summary['saves_measured']} saves),"
            f" without {'-' if without is None else f'{without:+.1f}'} KiB"
        )


if __name__ == "__main__":
    main()
