"""Lightning's fit loop after a resume, mended where Lightning 2.6 counts the epoch after the resumed one wrong.

A checkpoint saved at the end of an epoch's last batch (``ModelCheckpoint(every_n_train_steps=...)``, a preemption's
``last.ckpt``) resumes as "restarted mid-epoch": ``FitLoop.reset`` counts that epoch as finished (``processed``,
``completed``) but keeps its restart stage, so ``on_advance_start`` of the *next* epoch takes it for the restarted
one: it skips ``on_train_epoch_start`` and the epoch's ``ready``/``started`` counts. A checkpoint that run saves says no
epoch is in progress, and a run resumed from it seeds that epoch's shuffle with the previous epoch's number
(``DistributedSampler.set_epoch(epoch_progress.current.processed)``): it trains on other batches than a run never
stopped (seen: 0.01 off in the weights after two resumes with 2 shuffled batches an epoch, 2.2e-8 with one).
"""

from __future__ import annotations

from typing import Any


def start_next_epoch_afresh(fit_loop: Any) -> None:
    """Where ``FitLoop.reset`` has just counted a restarted epoch as finished (it had ended at its last batch), clear
    its restart stage, so the next epoch starts as in a run never stopped: its hooks run and its counts count it.
    Call between ``FitLoop.reset`` and the first epoch (a strategy's ``on_train_start``); elsewhere it does nothing."""
    epochs = fit_loop.epoch_progress.current
    if getattr(fit_loop, "restarted_mid_epoch", False) and epochs.processed == epochs.started:
        fit_loop.reset_restart_stage()
