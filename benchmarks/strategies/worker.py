"""One benchmark configuration in this process: train, save a checkpoint, resume from it.

Run by ``run.py`` as ``python benchmarks/strategies/worker.py MODEL CONFIG DEVICES OUT_DIR`` (``gpu.py`` adds
``--accelerator gpu --precision bf16-mixed``); with 2 devices Lightning's own launcher re-runs this script for
rank 1. Each rank writes ``OUT_DIR/rank<R>.json`` after every phase, so a
phase that fails or hangs still leaves the figures of the phases before it.

Memory is read from ``/proc/self/status`` (Linux). The floor is ``VmRSS`` after every import (including what
DeepSpeed would import lazily during ``deepspeed.initialize``) and before the model is built. Peaks are
``VmHWM`` over a phase, after resetting the high-water mark through ``/proc/self/clear_refs``: the setup peak up
to ``on_train_start`` (model build and engine setup); the training peak over the first steps, where RSS follows
live memory; the heap-malloc peak over the timed steps (see :func:`keep_buffers_in_heap`). On CUDA,
``torch.cuda.max_memory_allocated`` over setup and over training too.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (~40 MiB that `deepspeed.initialize` imports lazily)
import lightning as L
import peft  # noqa: F401  (imported for every configuration, so that every floor holds the same libraries)
import torch
import transformers  # noqa: F401
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning_frozen  # noqa: E402
from benchmarks.harness.probes import proc_status_bytes, reset_peak_rss, snapshot, tree_bytes  # noqa: E402
from benchmarks.harness.records import RankReport  # noqa: E402
from benchmarks.strategies import models  # noqa: E402
from benchmarks.strategies.configs import CONFIGS, Config  # noqa: E402
from tests.stock_cpu import stage_3_offload  # noqa: E402

MEMORY_STEPS = 4  # first, with RSS following live memory
WARMUP_STEPS = 2  # then glibc keeps buffers in its heap again; these let it grow
TIMED_STEPS = 6
TOTAL_STEPS = MEMORY_STEPS + WARMUP_STEPS + TIMED_STEPS
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
HEAP_MMAP_THRESHOLD = 32 * 1024 * 1024  # the ceiling glibc's dynamic threshold climbs to
LEARNING_RATE = 1e-3


def keep_buffers_in_heap() -> None:
    """Let glibc serve allocations up to 32 MiB from its heap, as its default dynamic threshold does once warm.

    ``run.py`` starts workers with ``MALLOC_MMAP_THRESHOLD_=1MiB``, so that at first every larger buffer is
    mapped and unmapped and RSS follows live memory. That costs a page fault per page of every buffer ZeRO-3
    gathers, doubling 2-rank step times; timed steps run after this call instead. The threshold cannot be made
    dynamic again, so it is set to the ceiling the dynamic one reaches.
    """
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)


def make_optimizer_fn(config: Config, lr_zero_params: list[torch.nn.Parameter]) -> Callable[[L.LightningModule], Any]:
    """What the user's ``configure_optimizers`` returns under ``config``.

    Every param, the frozen ones in an ``lr=0`` group for the workaround; DeepSpeed's CPU Adam where stock
    ZeRO-Offload demands it, else torch's AdamW (``frozen_deepspeed_offload`` converts that one itself).
    """

    def optimizer_fn(module: L.LightningModule) -> torch.optim.Optimizer:
        zero_ids = {id(p) for p in lr_zero_params}
        groups: list[dict] = [{"params": [p for p in module.parameters() if id(p) not in zero_ids]}]
        if lr_zero_params:
            groups.append({"params": lr_zero_params, "lr": 0.0})
        if config.cpu_adam:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=LEARNING_RATE)
        return torch.optim.AdamW(groups, lr=LEARNING_RATE)

    return optimizer_fn


def make_strategy(config: Config, devices: int, accelerator: str) -> Any:
    if config.key in ("frozen", "frozen_lr0"):
        return "frozen_deepspeed"
    if config.key == "frozen_offload":
        return "frozen_deepspeed_offload"
    if config.key in ("stock", "stock_lr0"):
        return stage_3_offload() if accelerator == "cpu" else "deepspeed_stage_3_offload"
    return "ddp" if devices > 1 else "auto"


def prepare_model(model: L.LightningModule, config: Config) -> None:
    """Give the model the optimizer of ``config``; for the ``lr=0`` workaround, unfreeze the frozen params first."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if config.lr_zero:
        for param in frozen:
            param.requires_grad_(True)
    model.optimizer_fn = make_optimizer_fn(config, frozen if config.lr_zero else [])


class Probe(Callback):
    """Step times, peak memory, when the first batch starts, and optionally the params at train start.

    Steps run in three phases: memory steps, whose RSS peak (``train_peak_rss``) follows live memory; then,
    after :func:`keep_buffers_in_heap`, warm-up and timed steps, whose RSS peak is ``heap_malloc_peak_rss``.
    The CUDA peak covers every step.
    """

    def __init__(self, started_at: float, snapshot_names: Optional[list[str]] = None) -> None:
        self.started_at = started_at
        self.cuda = torch.cuda.is_available()
        self.snapshot_names = snapshot_names
        self.start_snapshot: dict[str, torch.Tensor] = {}
        self.first_batch_after_s: Optional[float] = None
        self.first_global_step: Optional[int] = None
        self.step_s: list[float] = []
        self.setup_peak_rss = 0
        self.train_start_rss = 0
        self.train_peak_rss = 0
        self.heap_malloc_peak_rss = 0
        self.device: dict[str, int] = {}
        self._batch_started_at = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.snapshot_names is not None:
            self.start_snapshot = snapshot(pl_module, self.snapshot_names)
        self.setup_peak_rss = proc_status_bytes("VmHWM")
        self.train_start_rss = proc_status_bytes("VmRSS")
        reset_peak_rss()
        if self.cuda:
            self.device["setup_peak"] = torch.cuda.max_memory_allocated()
            self.device["train_start"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._batch_started_at = time.perf_counter()
        if self.first_batch_after_s is None:
            self.first_batch_after_s = self._batch_started_at - self.started_at
            self.first_global_step = trainer.global_step

    def on_train_batch_end(self, *args: Any) -> None:
        self.step_s.append(time.perf_counter() - self._batch_started_at)
        if len(self.step_s) == MEMORY_STEPS:
            self.train_peak_rss = proc_status_bytes("VmHWM")
            keep_buffers_in_heap()
            reset_peak_rss()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.heap_malloc_peak_rss = proc_status_bytes("VmHWM")
        if self.cuda:
            self.device["train_peak"] = torch.cuda.max_memory_allocated()


def make_trainer(config: Config, args: argparse.Namespace, max_steps: int, probe: Probe) -> L.Trainer:
    return L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=make_strategy(config, args.devices, args.accelerator),
        precision=args.precision,
        max_steps=max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[probe],
    )


def run(args: argparse.Namespace) -> None:
    config = CONFIGS[args.config]
    report = RankReport(args.out_dir)
    floor = proc_status_bytes("VmRSS")
    model = models.build(args.model)
    trainable_names = [name for name, p in model.named_parameters() if p.requires_grad]
    estimate = lightning_frozen.estimate_memory(
        model,
        num_devices=args.devices,
        precision=args.precision,
        offload_optimizer=config.key == "frozen_offload",
        print_table=False,
    )
    report.update(floor_rss=floor, estimate=estimate.as_dict())
    prepare_model(model, config)

    probe = Probe(time.perf_counter())
    trainer = make_trainer(config, args, TOTAL_STEPS, probe)
    trainer.fit(model, models.data(args.model))
    trained = snapshot(model, trainable_names)
    report.update(
        setup_peak_rss=probe.setup_peak_rss,
        train_start_rss=probe.train_start_rss,
        train_peak_rss=probe.train_peak_rss,
        heap_malloc_peak_rss=probe.heap_malloc_peak_rss,
        device_memory=probe.device,
        step_s=probe.step_s,
        step_median_s=statistics.median(probe.step_s[MEMORY_STEPS + WARMUP_STEPS :]),
        start_s=probe.first_batch_after_s,
    )

    path = args.out_dir / "checkpoint.ckpt"
    try:
        # the first save may pay one-time costs (our strategy fingerprints the frozen base once), the next not
        save_s = []
        for target in (path, args.out_dir / "next.ckpt"):
            trainer.strategy.barrier()
            started = time.perf_counter()
            trainer.save_checkpoint(target)
            save_s.append(time.perf_counter() - started)
        report.update(save_s=save_s[0], next_save_s=save_s[1], checkpoint_bytes=tree_bytes(path))
    except Exception:
        report.error("save")
        return
    saved_step = trainer.global_step
    del trainer, model
    gc.collect()

    try:
        model = models.build(args.model)
        prepare_model(model, config)
        probe = Probe(time.perf_counter(), snapshot_names=trainable_names)
        trainer = make_trainer(config, args, TOTAL_STEPS + 1, probe)
        trainer.fit(model, models.data(args.model), ckpt_path=path)
        resumed = probe.start_snapshot
        report.update(
            resume_s=probe.first_batch_after_s,
            resumed_global_step=probe.first_global_step,
            resumed_exactly=probe.first_global_step == saved_step
            and all(torch.equal(resumed[name], trained[name]) for name in trainable_names),
        )
    except Exception:
        report.error("resume")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=models.MODELS)
    parser.add_argument("config", choices=list(CONFIGS))
    parser.add_argument("devices", type=int)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
