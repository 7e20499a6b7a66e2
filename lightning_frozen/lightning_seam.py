"""The Lightning seam: every private name of Lightning that the package outside the strategy's hooks relies on, in
one module, written for Lightning 2.6 (2.6.6 tested). When Lightning changes, this is the one place to look.

- ``attached_trainer``: ``LightningModule._trainer`` (``LightningModule.trainer`` raises when none is attached).
- ``record_added_groups``: ``BaseFinetuning._store``, which remembers the param groups a ``finetune_function`` added.
- ``resolved_ckpt_path``: the ``ckpt_path`` argument of ``Trainer._run``, read from the call stack. Lightning resolves
  ``"last"``, ``"best"`` and ``"hpc"`` before ``_run`` and holds the result only there until it restores, after the
  strategy's setup (``trainer.ckpt_path`` is still the previous run's then); no public hook before setup hands it
  over, and a wrong path is worth refusing before a large base is loaded. Without ``_run``, nothing is read.
- For preemption: ``_SignalConnector`` and its ``_slurm_sigusr_handler_fn`` (Lightning's requeue), reached as
  ``trainer._signal_connector``; ``_get_sigkill_signal``; ``trainer._checkpoint_connector._hpc_resume_path``; and the
  epoch loop's ``_should_accumulate``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal, _SignalConnector

_TRAINER_RUN = getattr(getattr(pl.Trainer, "_run", None), "__code__", None)


def attached_trainer(module: Any) -> Optional[pl.Trainer]:
    """The Trainer ``module`` is attached to, or None (where ``module.trainer`` would raise)."""
    return getattr(module, "_trainer", None)


def record_added_groups(callback: Any, pl_module: Any, num_groups: int, groups: Sequence[dict]) -> None:
    """What Lightning's ``BaseFinetuning`` does after its ``finetune_function``: remember the groups added past
    ``num_groups``, so that its checkpoint state holds them."""
    callback._store(pl_module, 0, num_groups, groups)


def resolved_ckpt_path(trainer: pl.Trainer) -> Any:
    """The ``ckpt_path`` the running ``fit``/``validate``/``test``/``predict`` of ``trainer`` will restore, as
    Lightning resolved it; None when there is none or it cannot be read."""
    frame = inspect.currentframe() if _TRAINER_RUN is not None else None
    while frame is not None and not (frame.f_code is _TRAINER_RUN and frame.f_locals.get("self") is trainer):
        frame = frame.f_back
    return frame.f_locals.get("ckpt_path") if frame is not None else None


def is_lightnings_signal_handler(handler: Any) -> bool:
    """Whether ``handler`` is a bound method of Lightning's signal connector."""
    return isinstance(getattr(handler, "__self__", None), _SignalConnector)


def mid_accumulation(trainer: pl.Trainer) -> bool:
    """Whether the batch that just ended does not step the optimizer (gradient accumulation goes on)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def requeue(trainer: pl.Trainer, signum: int) -> Any:
    """Lightning's SLURM requeue (loggers finalized, ``hpc_ckpt_<n>.ckpt`` saved by every rank, ``scontrol
    requeue``); returns the checkpoint's path."""
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)
    return trainer._checkpoint_connector._hpc_resume_path


def sigkill_signal() -> int:
    """The signal Lightning ends its launched ranks with."""
    return _get_sigkill_signal()
