"""Stopping ``fit`` when the scheduler asks: SIGTERM (SLURM, Kubernetes, spot instances) or SLURM's requeue signal,
received by any rank or by all of them (docs/preemption.md).

The handler only records the signal (Lightning's broadcasts inside it, which deadlocks against a ZeRO-3 all-gather);
the ranks agree at the next step boundary, save, and exit with 128 + the signal. Before the first training step the
stop is raised, without a checkpoint, at the strategy's own boundaries (:meth:`Preemption.stop_before_training`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_frozen import capabilities, lightning_seam, process
from lightning_frozen.zero.collectives import any_rank

log = logging.getLogger(__name__)

# the file a SIGTERM stop writes without a ModelCheckpoint (or one whose last name has format fields)
STOP_CHECKPOINT_NAME = "last.ckpt"
DEFAULT_GRACE_SECONDS = 20.0


def exit_status(signum: int) -> int:
    """The status a stopped rank exits with: 128 + the signal number, as if the signal had ended the process."""
    return 128 + int(signum)


class Preemption:
    """The signals one ``fit`` received, the handler that records them, and the stop they lead to."""

    def __init__(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        self.grace = grace
        self.signum: Optional[int] = None
        self._requeue_signum: Optional[int] = None
        self._chained: dict[int, list[Callable[..., Any]]] = {}
        self._launcher: Any = None
        self._unwatched: list[subprocess.Popen] = []  # the ranks taken out of the launcher's list (stop_watching_ranks)
        self._signals: Optional[process.StopSignals] = None  # the handler and its watchdog, while a run is set up
        self.training = False  # whether a step boundary can be reached (the fit loop started): else a signal ends it
        self._signalled_at = 0.0
        self._on = False  # this run's stop is ours: else Lightning's signal handling runs (capabilities.PREEMPTION off)

    def install(self, trainer: pl.Trainer, launcher: Any) -> None:
        """Handle SIGTERM (and the requeue signal under SLURM auto-requeue) for this run instead of Lightning's
        signal connector, chaining the handlers set before it, with a watchdog that ends the process ``grace`` seconds
        after a signal (:meth:`uninstall` undoes it all). Idempotent within a run; off the main thread only the
        step-boundary callback is added; with ``capabilities.PREEMPTION`` off it does nothing."""
        if not capabilities.available(capabilities.PREEMPTION):
            return
        self._on = True
        self._launcher = launcher
        if not any(isinstance(callback, StopAtStepBoundary) for callback in trainer.callbacks):
            trainer.callbacks.append(StopAtStepBoundary(self))
        if threading.current_thread() is not threading.main_thread() or self._signals is not None:
            return
        environment = getattr(trainer.strategy, "cluster_environment", None)
        requeues = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        self._requeue_signum = int(environment.requeue_signal) if requeues and environment.requeue_signal else None
        signums = [s for s in (int(signal.SIGTERM), self._requeue_signum) if s is not None]
        self._chained = {s: _handlers_before_lightning(signal.getsignal(s)) for s in signums}
        lightning_seam.register_no_signal_handlers(trainer, True)
        self._signals = process.StopSignals(signums, self._record, self.grace, exit_status, self._end_ranks_now)

    def uninstall(self, trainer: Optional[pl.Trainer]) -> None:
        """The run ended: put back the handlers found at its start, end the watchdog, let Lightning's connector
        register handlers again, take the run's callback off ``trainer``, and forget the run's signal."""
        if trainer is not None and self._on:
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, StopAtStepBoundary)]
            lightning_seam.register_no_signal_handlers(trainer, False)
        if self._signals is not None:
            self._signals.close()
        self._signals, self._chained, self.signum, self.training, self._on = None, {}, None, False, False
        self._launcher, self._unwatched = None, []

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        # runs in the main thread between two bytecodes, maybe inside a collective: it records and writes one line;
        # the watchdog (process.StopSignals) bounds the stop, and acts at once on a second signal
        if self.signum is not None:
            process.exiting()  # a second signal: nothing is renamed into place before the watchdog ends the process
            return
        self.signum, self._signalled_at = signum, time.monotonic()
        name, status = signal.Signals(signum).name, exit_status(signum)
        if self.training:
            line = f"{name} received; stopping at the next step boundary (within {self.grace:g} s)"
        else:
            line = (
                f"{name} before the first training step: no step boundary to save at, so no checkpoint; stopping at"
                f" the next safe point (within {self.grace:g} s)"
            )
        os.write(2, f"lightning-frozen: {line}; exiting with status {status}.\n".encode())  # logging may be locked
        for handler in self._chained.get(signum, []):
            handler(signum, frame)

    def stop_before_training(self) -> None:
        """At one of the strategy's boundaries before the first training step, where nothing of another package is
        patched: end the run on this rank if it received a stop signal (not collective: see :meth:`end_run`).

        Raises:
            SIGTERMException: with status 128 + the signal, when this rank received one and no step boundary was
                reached yet.
        """
        if self.signum is not None and not self.training:
            raise SIGTERMException(exit_status(self.signum))

    def agree(self, strategy: Any) -> tuple[bool, bool]:
        """Whether any rank received SIGTERM, and whether any received the requeue signal. Collective when
        distributed: every rank calls it at the same step."""
        terminate = self.signum == signal.SIGTERM
        requeue = self.signum is not None and self.signum == self._requeue_signum
        terminate, requeue = any_rank([terminate, requeue], strategy.root_device)
        return terminate, requeue

    def end_run(self, exception: BaseException) -> None:
        """After ``fit`` raised ``exception`` on this rank: requeue the job when a requeue signal stopped it before the
        first training step (rank 0), then end the ranks this process launched (after a stop, once they have ended by
        themselves, within what is left of ``grace``, half of it before the first step; none where every rank raised
        it)."""
        if not self._on:
            return  # Lightning's signal handling ran the run
        if is_stop(exception):  # as at a step boundary: Lightning's observer would SIGKILL this rank as it waits
            self.unwatch_launched_ranks()  # for the others, or ends its run after they ended with 143
        before_training = is_stop(exception) and not self.training and self.signum is not None
        if before_training and self.signum == self._requeue_signum and requeue_without_checkpoint():
            log.warning("lightning-frozen: the job was requeued (no checkpoint: it had not trained yet).")
        if not raised_on_every_rank(exception):  # each rank that raised it goes on, or ends, by itself
            left = self.grace - (time.monotonic() - self._signalled_at) - 1.0 if self.signum is not None else self.grace
            # before the first step a rank that did not get the signal never stops by itself: half of what is left
            # for the others to end, half for this rank's own teardown, inside its deadline
            wait = left / 2 if before_training else left
            end_launched_ranks(self.launched_ranks(), max(wait, 0.0) if is_stop(exception) else 0.0)

    def _end_ranks_now(self) -> None:
        end_launched_ranks(self.launched_ranks(), wait=0.0)

    def unwatch_launched_ranks(self) -> None:
        """Once every rank ends by itself with a stop's status: Lightning's observer no longer watches the ranks this
        process launched (:func:`stop_watching_ranks`), and :meth:`end_run` still ends those that outlive the stop."""
        self._unwatched.extend(stop_watching_ranks(self._launcher))

    def launched_ranks(self) -> list[subprocess.Popen]:
        """The ranks this process launched (Lightning's subprocess launcher), watched by Lightning's observer or not."""
        return [*self._unwatched, *(getattr(self._launcher, "procs", None) or [])]


def mid_accumulation(trainer: pl.Trainer) -> bool:
    """Whether the batch that just ended does not step the optimizer (gradient accumulation goes on)."""
    # Lightning's `_should_accumulate` for a strategy that handles accumulation (DeepSpeed's), by public counters
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches != 0


def requeue_without_checkpoint() -> bool:
    """``scontrol requeue`` of this job from global rank 0, as Lightning's SLURM requeue does, before any checkpoint
    can be saved; returns whether this rank asked for it and ``scontrol`` succeeded."""
    if os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")) != "0":
        return False
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        return subprocess.call(["scontrol", "requeue", job]) == 0
    except OSError:
        return False


def _handlers_before_lightning(current: Any) -> list[Callable[..., Any]]:
    """The handlers Lightning's composed handler chains besides its own (a user's, set before ``fit``)."""
    handlers = getattr(current, "signal_handlers", [current])
    return [h for h in handlers if callable(h) and not lightning_seam.is_lightnings_signal_handler(h)]


class StopAtStepBoundary(Callback):
    """At the end of each batch that steps the optimizer, and of each validation batch inside ``fit`` (every rank runs
    the same ones, ``loops.py``): if any rank received a stop signal, save the last step's state and exit."""

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption
        self._last_boundary: Optional[float] = None
        self._warned = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_boundary = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if mid_accumulation(trainer):
            return  # mid-accumulation: the step boundary is the batch that steps
        self._check_grace()
        self._stop_if_agreed(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or not self.preemption.training:
            self.preemption.stop_before_training()  # sanity validation and `validate`: no step to save
            return
        self._check_grace()
        self._stop_if_agreed(trainer)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.preemption.stop_before_training()

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.preemption.stop_before_training()

    def _stop_if_agreed(self, trainer: pl.Trainer) -> None:
        terminate, requeue = self.preemption.agree(trainer.strategy)
        if not (terminate or requeue):
            return
        self.preemption.unwatch_launched_ranks()  # every rank now ends by itself, with a stop's non-zero status
        signum = signal.SIGTERM if terminate else self.preemption._requeue_signum or signal.SIGUSR1
        if terminate:
            path = stop_checkpoint_path(trainer)
            trainer.save_checkpoint(path, weights_only=False)  # the whole state, for a resume
        else:
            # Lightning's requeue: loggers finalized, `hpc_ckpt_<n>.ckpt` saved (every rank), `scontrol requeue`
            lightning_seam.requeue(trainer, signum)
            path = os.path.join(str(trainer.default_root_dir), "hpc_ckpt_<n>.ckpt")
        log.warning(
            "lightning-frozen: rank %d: %s received (on this rank: %s); stopped after step %d, checkpoint saved to"
            " %s; exiting with status %d.",
            trainer.global_rank,
            signal.Signals(signum).name,
            "yes" if self.preemption.signum is not None else "no",
            trainer.global_step,
            path,
            exit_status(signum),
        )
        raise SIGTERMException(exit_status(signum))

    def _check_grace(self) -> None:
        """Warn once when boundaries (the ends of training steps and of validation batches) lie further apart than
        the grace: a signal could not reach the next one."""
        now, grace = time.monotonic(), self.preemption.grace
        if self._last_boundary is not None and not self._warned and now - self._last_boundary > grace:
            self._warned = True
            rank_zero_warn(
                f"lightning-frozen: a training step (or validation batch) took {now - self._last_boundary:.0f} s,"
                " more than"
                f" `preemption_grace={grace:g}` s: after a SIGTERM this run cannot reach a step boundary in time, so it"
                " would exit without saving. Set `preemption_grace=` above the step time, and have the scheduler"
                " signal that much earlier (SLURM: `--signal=TERM@<seconds>`; Kubernetes:"
                " `terminationGracePeriodSeconds`)."
            )
        self._last_boundary = now


def stop_checkpoint_path(trainer: pl.Trainer) -> str:
    """Where a SIGTERM stop saves: the ``last`` file of the Trainer's ``ModelCheckpoint`` in its folder (so that
    ``fit(ckpt_path="last")`` resumes from it), else ``last.ckpt`` in ``default_root_dir``."""
    callback = trainer.checkpoint_callback
    if not (isinstance(callback, ModelCheckpoint) and callback.dirpath):
        return os.path.join(trainer.default_root_dir, STOP_CHECKPOINT_NAME)
    # its own last name when it has no format fields (`ckpt_path="last"` looks for files named so)
    name = callback.CHECKPOINT_NAME_LAST
    return os.path.join(callback.dirpath, STOP_CHECKPOINT_NAME if "{" in name else name + callback.FILE_EXTENSION)


def is_stop(exception: BaseException) -> bool:
    """Whether ``exception`` is the agreed stop of :class:`StopAtStepBoundary`: every rank is ending by itself."""
    return isinstance(exception, SIGTERMException) and isinstance(exception.code, int) and exception.code > 128


def raised_on_every_rank(exception: BaseException) -> bool:
    """Whether every rank raises ``exception`` at the same point (an agreed check, as ``UnevenBatchesError``): no rank
    is left waiting in a collective, so none is killed."""
    return bool(getattr(exception, "raised_on_every_rank", False))


def stop_watching_ranks(launcher: Any) -> list[subprocess.Popen]:
    """Take the ranks ``launcher`` (Lightning's subprocess launcher) started out of its public ``procs``, and return
    them: its observer SIGKILLs every rank once one ends non-zero, which races this rank's own stop."""
    procs = getattr(launcher, "procs", None)
    if not procs:
        return []
    taken = list(procs)
    procs.clear()  # in place: the observer holds this list, not the launcher
    return taken


def end_launched_ranks(processes: Sequence[subprocess.Popen], wait: float) -> None:
    """SIGKILL the ranks in ``processes`` that still run after ``wait`` seconds. Lightning ends the ranks it launched
    itself only on Ctrl+C: a rank left in a hang of its own would outlive the run."""
    for rank in processes:
        try:
            rank.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    for rank in processes:
        if rank.poll() is None:
            rank.send_signal(signal.SIGKILL)
