"""Stopping ``fit`` when the scheduler asks: SIGTERM (SLURM, Kubernetes, spot instances) or SLURM's requeue signal,
received by any rank or by all of them.

Lightning's own SIGTERM handler broadcasts from inside the signal handler. Under ZeRO-3 another rank may sit in an
all-gather at that moment, and both wait forever. Here the handler only records the signal. At the end of the next
batch that steps the optimizer, which every rank reaches, the ranks agree with one two-element ``all_reduce``; then
every rank takes part in saving the adapter checkpoint (rank 0 writes it), logs one line and exits with status
128 + the signal number, as a process the signal ended would. A SLURM requeue signal, under
``SLURMEnvironment(auto_requeue=True)``, saves Lightning's ``hpc_ckpt_<n>.ckpt`` and requeues the job, as Lightning
does, so the requeued job resumes by itself. A second signal, or a process still running ``grace`` seconds after
its first, exits at once: the temporary file of a checkpoint being written is removed first, so the previous file
stays whole.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_frozen import lightning_seam
from lightning_frozen.checkpoint.atomic_files import remove_temp_files_being_written

log = logging.getLogger(__name__)

# the file a SIGTERM stop writes without a ModelCheckpoint (or one whose last name has format fields)
STOP_CHECKPOINT_NAME = "last.ckpt"
DEFAULT_GRACE_SECONDS = 20.0


def exit_status(signum: int) -> int:
    """The status a stopped rank exits with: 128 + the signal number, as if the signal had ended the process."""
    return 128 + int(signum)


class Preemption:
    """The signals one ``fit`` received, the handlers that record them, and the deadline that bounds the stop."""

    def __init__(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        self.grace = grace
        self.signum: Optional[int] = None
        self._requeue_signum: Optional[int] = None
        self._chained: dict[int, list[Callable[..., Any]]] = {}
        self._launcher: Any = None
        self._deadline: Optional[threading.Timer] = None

    def install(self, trainer: pl.Trainer, launcher: Any) -> None:
        """Handle SIGTERM (and the requeue signal under SLURM auto-requeue) for this ``fit`` instead of Lightning, and
        stop at the next optimizer step boundary once any rank received one (see :class:`StopAtStepBoundary`).

        Handlers that were set before Lightning's still run, after this one. Lightning restores the handlers it
        found when the run ends. Call it from the main thread.
        """
        self.signum, self._launcher = None, launcher
        if self._deadline is not None:
            self._deadline.cancel()
        if not any(isinstance(callback, StopAtStepBoundary) for callback in trainer.callbacks):
            trainer.callbacks.append(StopAtStepBoundary(self))
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; Lightning's stay
        environment = getattr(trainer.strategy, "cluster_environment", None)
        requeues = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        self._requeue_signum = int(environment.requeue_signal) if requeues and environment.requeue_signal else None
        for signum in (signal.SIGTERM, self._requeue_signum):
            if signum is not None:
                self._chained[signum] = _handlers_before_lightning(signal.getsignal(signum))
                signal.signal(signum, self._record)

    def uninstall(self, trainer: Optional[pl.Trainer]) -> None:
        """The run ended: take its callback off ``trainer`` and drop the deadline (Lightning restores the handlers)."""
        if trainer is not None:
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, StopAtStepBoundary)]
        if self._deadline is not None:
            self._deadline.cancel()

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        # runs between two bytecodes of the main thread, maybe inside a collective: no collective, no file I/O here
        if self.signum is not None:
            self.exit_now(signum, f"a second {signal.Signals(signum).name} arrived")
        self.signum = signum
        self._deadline = threading.Timer(
            self.grace, self.exit_now, (signum, f"the rank did not stop within {self.grace:g} s")
        )
        self._deadline.daemon = True
        self._deadline.start()
        for handler in self._chained.get(signum, []):
            handler(signum, frame)

    def agree(self, strategy: Any) -> tuple[bool, bool]:
        """Whether any rank received SIGTERM, and whether any received the requeue signal. Collective when
        distributed: every rank calls it at the same step."""
        flags = torch.tensor(
            [self.signum == signal.SIGTERM, self.signum is not None and self.signum == self._requeue_signum],
            dtype=torch.int32,
            device=strategy.root_device,
        )
        if torch.distributed.is_available() and torch.distributed.is_initialized() and strategy.world_size > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def end_run(self, launcher: Any, exception: BaseException) -> None:
        """After ``fit`` raised ``exception`` on this rank: end the ranks ``launcher`` started (after an agreed stop,
        once they have ended by themselves, within ``grace``; none where every rank raised it), then drop the deadline
        of this process."""
        if not raised_on_every_rank(exception):  # each rank that raised it goes on, or ends, by itself
            end_launched_ranks(launcher, self.grace if is_stop(exception) else 0.0)
        if self._deadline is not None:
            self._deadline.cancel()

    def exit_now(self, signum: int, why: str) -> None:
        """End this process at once with :func:`exit_status`: remove the temporary file of a checkpoint being
        written (the previous file stays whole) and end the ranks this process launched."""
        removed = remove_temp_files_being_written()
        unfinished = f" (removed the unfinished {', '.join(p.name for p in removed)})" if removed else ""
        # straight to stderr: the main thread may hold the logging locks (this runs in a signal handler or a timer)
        message = f"lightning-frozen: {why}; exiting now with status {exit_status(signum)}{unfinished}.\n"
        os.write(2, message.encode())
        end_launched_ranks(self._launcher, wait=0.0)
        os._exit(exit_status(signum))


def _handlers_before_lightning(current: Any) -> list[Callable[..., Any]]:
    """The handlers Lightning's composed handler chains besides its own (a user's, set before ``fit``)."""
    handlers = getattr(current, "signal_handlers", [current])
    return [h for h in handlers if callable(h) and not lightning_seam.is_lightnings_signal_handler(h)]


class StopAtStepBoundary(Callback):
    """At the end of each batch that steps the optimizer: if any rank received a stop signal, save and exit."""

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if lightning_seam.mid_accumulation(trainer):
            return  # mid-accumulation: the step boundary is the batch that steps
        terminate, requeue = self.preemption.agree(trainer.strategy)
        if not (terminate or requeue):
            return
        lightning_seam.stop_watching_ranks()  # every rank now ends by itself, with a stop's non-zero status
        signum = signal.SIGTERM if terminate else self.preemption._requeue_signum or signal.SIGUSR1
        if terminate:
            path = stop_checkpoint_path(trainer)
            trainer.save_checkpoint(path)
        else:
            # Lightning's requeue: loggers finalized, `hpc_ckpt_<n>.ckpt` saved (every rank), `scontrol requeue`
            path = lightning_seam.requeue(trainer, signum)
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


def end_launched_ranks(launcher: Any, wait: float) -> None:
    """SIGKILL the ranks ``launcher`` (Lightning's subprocess launcher) started that still run after ``wait``
    seconds. Lightning ends them itself only on Ctrl+C: a rank left in a hang of its own would outlive the run."""
    processes = list(getattr(launcher, "procs", None) or [])
    for process in processes:
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    for process in processes:
        if process.poll() is None:
            process.send_signal(lightning_seam.sigkill_signal())
