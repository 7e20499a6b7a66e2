"""What one switch of the trainable set costs under ``frozen_deepspeed``: time and peak memory of the rebuild.

A frozen backbone of ``--layers`` x ``--width``^2 params and a trainable head train for one epoch; at epoch 1
``lightning_frozen.BaseFinetuning`` unfreezes the last ``--unfreeze`` layers. The rebuild (gather the trainable
state, destroy the engine, initialise it again, restore the state) is timed inside
``FrozenAwareDeepSpeedStrategy.reconfigure_trainable`` and set against the time of one training step; peak
resident memory (``VmHWM``) is read before and after it, and set against the bytes that start training.

    python benchmarks/unfreeze_switch/run.py            # 1 process, about a minute on 2 CPU cores
    python benchmarks/unfreeze_switch/run.py --devices 2 --out OUT   # results/unfreeze_switch_2proc.json here

Rank 0 writes the figures to ``--out`` (default ``results/unfreeze_switch.json`` here) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning_frozen  # noqa: E402
from benchmarks.harness.probes import proc_status_bytes  # noqa: E402
from benchmarks.harness.records import write_json  # noqa: E402
from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402


class Backbone(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class UnfreezeLast(lightning_frozen.BaseFinetuning):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone[-self.count :], optimizer, lr=1e-5)


class Timed(FrozenAwareDeepSpeedStrategy):
    """Records the wall time and the peak-RSS growth of each rebuild."""

    switches: list[dict[str, float]] = []

    def reconfigure_trainable(self, param_groups: list[dict[str, Any]], origins: list) -> None:
        rss_before = proc_status_bytes("VmHWM")
        start = time.perf_counter()
        super().reconfigure_trainable(param_groups, origins)
        self.switches.append(
            {"seconds": time.perf_counter() - start, "peak_rss_growth": proc_status_bytes("VmHWM") - rss_before}
        )


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.durations: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.durations.append(time.perf_counter() - self._start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--unfreeze", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "unfreeze_switch.json")
    args = parser.parse_args()

    module = Backbone(args.width, args.layers)
    unfrozen = sum(p.numel() for p in module.backbone[-args.unfreeze :].parameters())
    frozen = sum(p.numel() for p in module.backbone.parameters())
    samples = args.steps_per_epoch * 8 * args.devices
    data = DataLoader(TensorDataset(torch.randn(samples, args.width), torch.randn(samples, 1)), batch_size=8)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=Timed(),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[UnfreezeLast(args.unfreeze), timer],
    )
    trainer.fit(module, data)
    switch = Timed.switches[0]
    first_epoch = timer.durations[1 : args.steps_per_epoch]  # skip the first (warm-up) step
    second_epoch = timer.durations[args.steps_per_epoch + 1 :]
    step = sorted(first_epoch)[len(first_epoch) // 2]
    figures = {
        "date": time.strftime("%Y-%m-%d"),
        "devices": args.devices,
        "frozen_params": frozen,
        "unfrozen_params": unfrozen,
        "switch_seconds": switch["seconds"],
        "median_step_seconds_before": step,
        "median_step_seconds_after": sorted(second_epoch)[len(second_epoch) // 2],
        "switch_in_steps": switch["seconds"] / step,
        "switch_peak_rss_growth_bytes": switch["peak_rss_growth"],
        # what starts training: fp32 master + two Adam moments + fp32 gradient per unfrozen element, per rank
        "new_trainable_state_bytes_per_rank": unfrozen * 16 // args.devices,
    }
    if trainer.is_global_zero:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, figures)
        print("| figure | value |\n|---|---|")
        for key, value in figures.items():
            print(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")


if __name__ == "__main__":
    main()
