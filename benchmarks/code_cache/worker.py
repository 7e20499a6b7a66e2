"""One fit in one process (and, on 2 ranks, the one Lightning's launcher starts): ``from_pretrained`` + PEFT LoRA in
``configure_model`` under ``FrozenAwareDeepSpeedStrategy(frozen_dtype=..., code_cache=...)``, as a user writes it.

What it records in ``<run_dir>/rank<R>.json`` (rewritten after every phase, so a run killed mid-way keeps what it
measured): seconds from ``trainer.fit`` to ``configure_model``, to ``on_train_start`` and to the first
``on_train_batch_start``; each step's wall time, the bytes this process read from storage during it
(``/proc/self/io`` ``read_bytes``: page-cache misses, mapped-file faults included) and its major faults; the peaks of
USS, ``RssAnon`` and RSS (sampled every 0.1 s, per phase: load up to ``on_train_start``, then training), ``VmHWM`` and
``smaps_rollup``'s ``Anonymous`` at the end; the package's ``lightning-frozen`` log lines with their times (the cache
says there why it re-encodes); and the cache folder's files after the fit.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness.probes import PeakSampler, memory_now, proc_status
from benchmarks.harness.records import RankReport
from lightning_frozen import FrozenAwareDeepSpeedStrategy


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (all its threads): ``read_bytes`` is what came from storage."""
    with open("/proc/self/io") as io:
        return {line.split(":")[0]: int(line.split()[1]) for line in io}


def major_faults() -> int:
    with open("/proc/self/stat") as stat:
        text = stat.read()
    return int(text[text.rindex(")") + 2 :].split()[9])  # majflt


def smaps_anonymous() -> int:
    """``Anonymous`` of ``/proc/self/smaps_rollup`` in bytes (0 where the kernel has no rollup)."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class LogLines(logging.Handler):
    """The package's log lines, with the seconds since ``trainer.fit`` they came at."""

    def __init__(self, clock: dict[str, float]) -> None:
        super().__init__()
        self.clock, self.lines = clock, []
        for name in ("lightning_frozen", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).addHandler(self)
        logging.getLogger("lightning_frozen").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "lightning-frozen" in message or record.name.startswith("lightning_frozen"):
            elapsed = time.perf_counter() - self.clock.get("fit", time.perf_counter())
            self.lines = [*self.lines, f"{elapsed:8.1f} s  {message[:400]}"][-80:]


class LoRACausalLM(L.LightningModule):
    """``from_pretrained`` + ``get_peft_model`` in ``configure_model``, timed."""

    def __init__(self, folder: str, lora: dict[str, Any], times: dict[str, float], clock: dict[str, float]) -> None:
        super().__init__()
        self.folder, self.lora, self.times, self.clock = folder, lora, times, clock
        self.losses: list[float] = []
        self.stop_at_first_step = False

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        started = time.perf_counter()
        self.times["configure_model_at"] = round(started - self.clock["fit"], 3)
        base = AutoModelForCausalLM.from_pretrained(self.folder)
        loaded = time.perf_counter()
        self.model = get_peft_model(base, LoraConfig(**self.lora))
        self.times["from_pretrained_s"] = round(loaded - started, 3)
        self.times["get_peft_model_s"] = round(time.perf_counter() - loaded, 3)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        # a fit asked for no step stops at its first one's start (Lightning ends the epoch where this returns -1)
        return -1 if self.stop_at_first_step else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.losses.append(round(float(loss.detach().float()), 5))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Probe(Callback):
    """Phase boundaries, and each step's time, storage reads and major faults."""

    def __init__(self, sampler: PeakSampler, report: RankReport, clock: dict[str, float]) -> None:
        self.sampler, self.report, self.clock = sampler, report, clock
        self.steps: list[dict[str, Any]] = []
        self._began, self._io, self._faults = 0.0, {}, 0

    def _at(self) -> float:
        return round(time.perf_counter() - self.clock["fit"], 3)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.report.update(
            train_start_at=self._at(),
            load_peaks=self.sampler.end_phase(),
            held_at_train_start=memory_now(),
            io_at_train_start=proc_io(),
            frozen_params=sum(
                p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters() if not p.requires_grad
            ),
            trainable_params=sum(
                p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters() if p.requires_grad
            ),
        )

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.steps:
            self.report.update(first_step_at=self._at(), io_at_first_step=proc_io())
        self._began, self._io, self._faults = time.perf_counter(), proc_io(), major_faults()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        seconds = time.perf_counter() - self._began
        io = proc_io()
        self.steps.append(
            dict(
                s=round(seconds, 3),
                read_bytes=io["read_bytes"] - self._io["read_bytes"],
                rchar=io["rchar"] - self._io["rchar"],
                major_faults=major_faults() - self._faults,
                anon_after=proc_status(("RssAnon",))["RssAnon"],
                loss=module.losses[-1] if module.losses else None,
            )
        )
        self.report.update(steps=self.steps, train_peaks_so_far=self.sampler.peaks())

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.report.update(train_peaks=self.sampler.end_phase())


def make_strategy(spec: dict[str, Any], report: RankReport) -> FrozenAwareDeepSpeedStrategy:
    """The strategy of ``spec``; ``code_cache`` passed only where the spec names one and the strategy takes it (the
    report says whether it did)."""
    kwargs: dict[str, Any] = {"frozen_dtype": None if spec["frozen_dtype"] == "none" else spec["frozen_dtype"]}
    takes = "code_cache" in inspect.signature(FrozenAwareDeepSpeedStrategy.__init__).parameters
    if spec.get("code_cache") is not None and takes:
        kwargs["code_cache"] = spec["code_cache"]
    report.update(code_cache_argument=kwargs.get("code_cache", "not passed"), strategy_takes_code_cache=takes)
    return FrozenAwareDeepSpeedStrategy(**kwargs)


def run(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    report = RankReport(spec_path.parent)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sampler = PeakSampler(0.1, spec_path.parent / f"running{rank}.json")
    report.update(floor=memory_now(), pid=os.getpid(), threads=torch.get_num_threads(), io_at_start=proc_io())
    sampler.start()
    clock: dict[str, float] = {}
    log_lines = LogLines(clock)
    times: dict[str, Any] = {}
    vocab = json.loads((Path(spec["folder"]) / "config.json").read_text())["vocab_size"]
    try:
        strategy = make_strategy(spec, report)
    except Exception:
        report.error("strategy")
        return
    probe = Probe(sampler, report, clock)
    module = LoRACausalLM(spec["folder"], spec["lora"], times, clock)
    module.stop_at_first_step = spec["steps"] == 0
    trainer = L.Trainer(
        accelerator="cpu",
        devices=spec["devices"],
        strategy=strategy,
        precision=spec["precision"],
        max_steps=spec["steps"] or -1,
        max_epochs=1 if spec["steps"] == 0 else -1,
        default_root_dir=spec_path.parent,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[probe],
    )
    rows = spec["devices"] * (spec["steps"] + 2)
    tokens = torch.randint(0, vocab, (rows, spec["sequence"]), generator=torch.Generator().manual_seed(0))
    clock["fit"] = time.perf_counter()
    try:
        trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=1))
    except Exception:
        report.update(times=times, log=log_lines.lines)
        report.error("fit")
        sampler.stop()
        return
    sampler.stop()
    cache = Path(spec["cache_dir"]) if spec.get("cache_dir") else None
    report.update(
        times=times,
        fit_s=round(time.perf_counter() - clock["fit"], 3),
        global_step=trainer.global_step,
        log=log_lines.lines,
        vm_hwm=proc_status(("VmHWM",))["VmHWM"],
        smaps_anonymous_end=smaps_anonymous(),
        io_at_end=proc_io(),
        cache_files={str(p.relative_to(cache)): p.stat().st_size for p in sorted(cache.rglob("*")) if p.is_file()}
        if cache is not None and cache.exists()
        else {},
    )
