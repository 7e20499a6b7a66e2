"""One configuration of ``run.py``, in this process: LoRA fit on the folder's base, save, resume.

Started by the driver as ``python benchmarks/big_model/run.py --worker SPEC.json``; with 2 devices Lightning's
launcher re-runs that command for rank 1. Each rank writes ``rank<R>.json`` next to the spec after every phase
(``benchmarks.harness.records.RankReport``), so a run killed by the driver's timeout or memory guard still leaves the
figures of the phases it finished.

Phases and what each records (times in seconds from rank 0's ``trainer.fit`` call, per rank):
- **floor**: this process's memory after every import, before the model is built;
- **load**: ``configure_model`` (``from_pretrained`` + ``get_peft_model``), DeepSpeed's engine setup and the
  fingerprint of the frozen base (timed around ``strategy.frozen_base_fingerprint``), to ``on_train_start``;
- **train**: warm-up and timed steps (wall time of each, ``on_train_batch_start`` to ``on_train_batch_end``; inside
  it, when the forward, the backward and the optimizer's step ended or began: ``step_phases``), each followed by a
  canary (``--canary``) outside its time; after the last step, the seconds to the epoch's end, the training's end and
  ``fit``'s return (``after_last_step``);
- **save**: ``trainer.save_checkpoint`` (time and bytes);
- **resume**: a new module and ``Trainer`` fitting one more step from the checkpoint; the global step it starts
  from and whether its adapter weights at ``on_train_start`` equal those saved.
Memory is sampled by a thread every ``sample_s``: USS, anonymous memory (``RssAnon``) and RSS, peak per phase.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.big_model.step_profile import PairedFloor, StepProfile, floors
from benchmarks.harness.probes import CanaryCycle, PeakSampler, memory_now, snapshot, thread_cpu_s, tree_bytes
from benchmarks.harness.records import RankReport
from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.memory import measured_frozen_shard_bytes, stored_as
from lightning_frozen.zero.params import full_numel

LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
LOG_LINES_KEPT = 60


class LogLines(logging.Handler):
    """Keeps the package's log lines (``lightning-frozen: ...``) with the time they came, from ``clock``."""

    def __init__(self, clock: dict[str, float]) -> None:
        super().__init__()
        self.clock = clock
        self.lines: list[str] = []
        for name in ("lightning_frozen", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "lightning-frozen" in message:
            elapsed = time.perf_counter() - self.clock.get("fit", time.perf_counter())
            self.lines = [*self.lines, f"{elapsed:8.1f} s  {message[:400]}"][-LOG_LINES_KEPT:]


class LoRACausalLM(L.LightningModule):
    """``from_pretrained`` + PEFT LoRA in ``configure_model``, as a user writes it; timings into ``times``."""

    def __init__(self, folder: str, lora: dict[str, Any], times: dict[str, float], clock: dict[str, float]) -> None:
        super().__init__()
        self.folder, self.lora, self.times, self.clock = folder, lora, times, clock
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        started = time.perf_counter()
        self.times["configure_model_at"] = started - self.clock["fit"]
        base = AutoModelForCausalLM.from_pretrained(self.folder)
        loaded = time.perf_counter()
        self.model = get_peft_model(base, LoraConfig(**self.lora))
        self.times["from_pretrained_s"] = loaded - started
        self.times["get_peft_model_s"] = time.perf_counter() - loaded

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.losses.append(float(loss.detach().float()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # every param, as users write it: the strategy leaves the frozen ones out
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Probe(Callback):
    """Phase boundaries, step times and the frozen shards held; on a resume, the adapter weights at the start."""

    def __init__(
        self,
        prefix: str,
        sampler: PeakSampler,
        report: RankReport,
        clock: dict[str, float],
        canary: Sequence[str] = ("small",),
    ) -> None:
        self.prefix, self.sampler, self.report, self.clock = prefix, sampler, report, clock
        self.snapshot_names: Optional[list[str]] = None
        self.start_snapshot: dict[str, torch.Tensor] = {}
        self.first_global_step: Optional[int] = None
        self.step_s: list[float] = []
        self.step_began: list[float] = []  # wall-clock starts, to line steps up with samples taken outside the process
        self.step_threads: list[dict[str, float]] = []  # CPU seconds of each thread that used >= 10 ms in the step
        self.canary: list[dict[str, Any]] = []  # the machine's canary after each step (CanaryCycle)
        self._canary = CanaryCycle(canary)
        # seconds from each step's start to the hooks inside it, and from the last step's end to the hooks after it
        self.step_phases: list[dict[str, float]] = []
        self.after_last_step: dict[str, float] = {}
        self._started, self._threads_before, self._ended = 0.0, {}, 0.0

    def _at(self) -> float:
        return round(time.perf_counter() - self.clock["fit"], 3)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        frozen = [p for p in module.parameters() if not p.requires_grad]
        shard_bytes, device = measured_frozen_shard_bytes(frozen)
        self.report.update(
            **{
                f"{self.prefix}train_start_at": self._at(),
                f"{self.prefix}load_peaks": self.sampler.end_phase(),
                f"{self.prefix}held_at_train_start": memory_now(),
                "frozen_params": sum(full_numel(p) for p in frozen),
                "trainable_params": sum(full_numel(p) for p in module.parameters() if p.requires_grad),
                "frozen_shard_bytes": shard_bytes,
                "frozen_stored_as": f"{stored_as(frozen)} on {device}",
                "world_size": trainer.world_size,
            }
        )
        if self.snapshot_names is not None:
            self.start_snapshot = snapshot(module, self.snapshot_names)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._started = time.perf_counter()
        self.step_phases.append({})
        self.step_began.append(round(time.time(), 3))
        self._threads_before = thread_cpu_s()
        if self.first_global_step is None:
            self.first_global_step = trainer.global_step
            self.report.update(**{f"{self.prefix}first_step_at": self._at()})

    def _phase(self, name: str) -> None:
        self.step_phases[-1][name] = round(time.perf_counter() - self._started, 3)

    def on_before_backward(self, *args: Any) -> None:
        self._phase("forward_done")

    def on_after_backward(self, *args: Any) -> None:
        self._phase("backward_done")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._phase("optimizer_step_begins")

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self._ended = time.perf_counter()
        self.step_s.append(round(self._ended - self._started, 3))
        used = {n: round(s - self._threads_before.get(n, 0.0), 2) for n, s in thread_cpu_s().items()}
        self.step_threads.append({n: s for n, s in used.items() if s >= 0.01})
        self.canary.append(self._canary.sample())
        self.report.update(
            **{
                f"{self.prefix}step_s": self.step_s,
                f"{self.prefix}step_began": self.step_began,
                f"{self.prefix}step_threads": self.step_threads,
                f"{self.prefix}canary": self.canary,
                f"{self.prefix}step_phases": self.step_phases,
                f"{self.prefix}losses": module.losses,
            }
        )
        self._ended = time.perf_counter()  # what follows the last step is timed from here, the canary left out

    def after_last(self, name: str) -> None:
        """Seconds from the last step's end (its canary and record done) to ``name``."""
        self.after_last_step[name] = round(time.perf_counter() - self._ended, 3)
        self.report.update(**{f"{self.prefix}after_last_step": self.after_last_step})

    def on_train_epoch_end(self, *args: Any) -> None:
        self.after_last("train_epoch_end")

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.after_last("train_end")
        self.report.update(**{f"{self.prefix}train_peaks": self.sampler.end_phase()})


def make_strategy(spec: dict[str, Any], fingerprint_s: list[float]) -> FrozenAwareDeepSpeedStrategy:
    """The strategy of ``spec``, its fingerprint timed (the first call does the pass; later ones are cached)."""
    frozen_dtype = None if spec["frozen_dtype"] == "none" else spec["frozen_dtype"]
    strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype)
    if hasattr(strategy, "frozen_base_fingerprint"):
        original = strategy.frozen_base_fingerprint

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = original(*args, **kwargs)
            fingerprint_s.append(round(time.perf_counter() - started, 3))
            return result

        strategy.frozen_base_fingerprint = timed  # type: ignore[method-assign]
    return strategy


def make_trainer(spec: dict[str, Any], strategy: Any, max_steps: int, probe: Probe, *extra: Callback) -> L.Trainer:
    return L.Trainer(
        accelerator=spec.get("accelerator", "cpu"),
        devices=spec["devices"],
        strategy=strategy,
        precision=spec["precision"],
        max_steps=max_steps,
        max_epochs=-1,
        # a SIGTERM stop saves `last.ckpt` in `default_root_dir`: the run's folder, not the working directory
        default_root_dir=Path(spec["checkpoint"]).parent,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[probe, *extra],
    )


def random_tokens(spec: dict[str, Any], vocab: int) -> DataLoader:
    rows = spec["batch"] * spec["devices"] * (spec["warmup"] + spec["steps"] + 2)
    tokens = torch.randint(0, vocab, (rows, spec["sequence"]), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=spec["batch"])


def run(spec_path: Path) -> None:
    """Run the phase of ``spec_path`` (written by the driver): ``train`` (fit, then save the checkpoint and the
    trained adapter weights) or ``resume`` (a fresh process fitting one more step from that checkpoint). This
    rank's figures go to ``rank<R>.json`` next to the spec; a resume's keys start with ``resume_``."""
    spec = json.loads(spec_path.read_text())
    resume = spec["phase"] == "resume"
    prefix = "resume_" if resume else ""
    torch.set_num_threads(spec["threads"])
    if spec.get("decode_whole"):  # the alternative measured beside it: no layer computes from codes
        from lightning_frozen.zero.compute import coded_linear

        coded_linear.CodedLayers.compute_from_codes = lambda self, model, frozen_dtype_of: 0
    if spec.get("exchange_codes"):  # likewise: the ranks do not share their codes, they all-gather them
        from lightning_frozen.zero import frozen_files

        frozen_files.share_codes = lambda params, frozen_dtype_of, spill=None: 0
    if spec.get("experts_whole"):  # likewise: every MoE layer's fused experts decoded whole, routed or not
        from lightning_frozen.zero.compute import coded_experts

        coded_experts.compute_experts_from_codes = lambda *args: 0
    report = RankReport(spec_path.parent)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sampler = PeakSampler(spec["sample_s"], spec_path.parent / f"running{rank}.json")
    report.update(**{f"{prefix}floor": memory_now(), f"{prefix}pid": os.getpid(), "threads": torch.get_num_threads()})
    sampler.start()
    clock: dict[str, float] = {}
    log_lines = LogLines(clock)
    times: dict[str, Any] = {}
    fingerprint_s: list[float] = []
    vocab = json.loads((Path(spec["folder"]) / "config.json").read_text())["vocab_size"]
    try:
        strategy = make_strategy(spec, fingerprint_s)
    except Exception:  # e.g. a frozen_dtype this branch refuses: recorded, the next configuration goes on
        report.error(f"{prefix}strategy")
        return
    probe = Probe(prefix, sampler, report, clock, spec.get("canary") or ["small"])
    module = LoRACausalLM(spec["folder"], spec.get("lora") or LORA, times, clock)
    checkpoint, adapter = Path(spec["checkpoint"]), Path(spec["trained_adapter"])
    if resume:
        trained = torch.load(adapter, weights_only=True)
        probe.snapshot_names = sorted(trained)
        saved_step = json.loads(Path(spec["saved_step_file"]).read_text())["global_step"]
    max_steps = saved_step + 1 if resume else spec["warmup"] + spec["steps"]
    profile = StepProfile(max_steps - 1) if spec.get("profile") and not resume else None
    paired = PairedFloor(record_step=0) if spec.get("paired_floor") and not resume else None
    trainer = make_trainer(spec, strategy, max_steps, probe, *[c for c in (profile, paired) if c is not None])
    clock["fit"] = time.perf_counter()
    try:
        trainer.fit(module, random_tokens(spec, vocab), ckpt_path=checkpoint if resume else None)
    except Exception:
        report.update(
            **{f"{prefix}times": times, f"{prefix}fingerprint_s": fingerprint_s, f"{prefix}log": log_lines.lines}
        )
        report.error(f"{prefix}fit")
        return
    probe.after_last("fit_returned")
    report.update(
        **{
            f"{prefix}times": times,
            f"{prefix}fingerprint_s": fingerprint_s,
            f"{prefix}global_step": trainer.global_step,
            f"{prefix}log": log_lines.lines,
        }
    )
    if resume:
        equal = [torch.equal(probe.start_snapshot[name], trained[name]) for name in sorted(trained)]
        report.update(
            resumed_from_step=probe.first_global_step,
            saved_step=saved_step,
            resumed_weights_equal=bool(equal) and all(equal),
            resumed_exactly=probe.first_global_step == saved_step
            and bool(equal)
            and all(equal)
            and trainer.global_step == saved_step + 1,
        )
    else:
        if profile is not None and profile.result:
            report.update(profile=profile.result)
            floor = floors(profile.result, spec["frozen_dtype"], profile.decoded_weights, profile.gathered_bytes)
            report.update(profile_floors=floor)
        if paired is not None:
            report.update(paired_floor=paired.result())
        save(trainer, module, checkpoint, adapter, Path(spec["saved_step_file"]), report, sampler)
    sampler.stop()


def save(
    trainer: L.Trainer,
    module: LoRACausalLM,
    checkpoint: Path,
    adapter: Path,
    step_file: Path,
    report: RankReport,
    sampler: PeakSampler,
) -> None:
    """Time ``trainer.save_checkpoint``; rank 0 also writes the adapter weights gathered from their shards and the
    global step, for the resume to compare with."""
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    trained = snapshot(module, names)
    try:
        trainer.strategy.barrier()
        started = time.perf_counter()
        trainer.save_checkpoint(checkpoint)
        report.update(
            save_s=round(time.perf_counter() - started, 3),
            checkpoint_bytes=tree_bytes(checkpoint),
            save_peaks=sampler.end_phase(),
        )
    except Exception:
        report.error("save")
        return
    if trainer.is_global_zero:
        torch.save(trained, adapter)
        step_file.write_text(json.dumps({"global_step": trainer.global_step}))
