"""Lightning's loops where ZeRO-3 or a resume needs more of them: evaluation data that every rank has as much of
(:func:`check_even_batches`, :class:`EvenBatches`: a rank with one more batch would hang in its gather; both raise
:class:`UnevenBatchesError` on every rank at once, docs/loops.md), and the fit loop after a resume, whose next epoch
Lightning 2.6 counts as the restarted one (:func:`start_next_epoch_afresh`, docs/checkpoints.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning.pytorch.trainer.states import RunningStage

from lightning_frozen.capabilities import RESUMED_EPOCH, available
from lightning_frozen.errors import UnevenBatchesError
from lightning_frozen.zero.collectives import gather_objects

# gathers one picklable value from every rank, in rank order (a collective)
GatherFromRanks = Callable[[Any], list[Any]]

_FIX = (
    " Give every rank as many batches: let Lightning add its DistributedSampler (`use_distributed_sampler=True`, the"
    " default), or make your own sampler or IterableDataset split the data evenly (pad or drop the remainder)."
)


def start_next_epoch_afresh(fit_loop: Any) -> None:
    """Where ``FitLoop.reset`` has just counted a restarted epoch as finished (it had ended at its last batch), clear
    its restart stage, so the next epoch starts as in a run never stopped: its hooks run and its counts count it.
    Call between ``FitLoop.reset`` and the first epoch (a strategy's ``on_train_start``); elsewhere it does nothing,
    as where ``capabilities.RESUMED_EPOCH`` is off."""
    epochs = fit_loop.epoch_progress.current
    if not available(RESUMED_EPOCH):
        return
    if fit_loop.restarted_mid_epoch and epochs.processed == epochs.started:
        fit_loop.reset_restart_stage()


def even_dataloader(dataloader: object, trainer: Any, world_size: int) -> object:
    """``dataloader`` as Lightning gave it, or, for evaluation on several ranks without a length, wrapped in
    :class:`EvenBatches` (a strategy's ``process_dataloader``)."""
    stage = trainer.state.stage
    if world_size > 1 and stage is not None and stage != RunningStage.TRAINING and not has_length(dataloader):
        return EvenBatches(dataloader, str(stage.dataloader_prefix), gather_objects)
    return dataloader


def check_even_batches_at_start(trainer: Any, world_size: int) -> None:
    """:func:`check_even_batches` for the evaluation loop starting now (a strategy's ``on_{validation,test,predict}
    _start``)."""
    if world_size == 1:
        return
    stage = trainer.state.stage
    if stage == RunningStage.SANITY_CHECKING:
        counts = trainer.num_sanity_val_batches
    else:
        counts = {RunningStage.TESTING: trainer.num_test_batches, RunningStage.PREDICTING: trainer.num_predict_batches}
        counts = counts.get(stage, trainer.num_val_batches)
    check_even_batches(str(stage.dataloader_prefix), counts, gather_objects)


def has_length(dataloader: object) -> bool:
    """Whether ``dataloader`` knows its number of batches (a ``DataLoader`` over an ``IterableDataset`` may not)."""
    try:
        len(dataloader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return False
    return True


def check_even_batches(stage: str, counts: Sequence[float], gather: GatherFromRanks) -> None:
    """Raise :class:`UnevenBatchesError` on every rank when the ranks' batch ``counts`` (one per dataloader of
    ``stage``; ``inf`` where unknown) differ among those known: before the loop's first gather. Collective."""
    every = gather([float(count) for count in counts])
    known = [[count if math.isfinite(count) else None for count in ranks] for ranks in every]
    if any(len(ranks) != len(known[0]) for ranks in known):
        per_rank = _per_rank({rank: len(ranks) for rank, ranks in enumerate(every)})
        raise UnevenBatchesError(f"The ranks have different numbers of {stage} dataloaders: {per_rank}.{_FIX}")
    for index, column in enumerate(zip(*known)):
        sizes = {count for count in column if count is not None}
        if len(sizes) > 1:
            per_rank = _per_rank({rank: int(count) for rank, count in enumerate(column) if count is not None})
            raise UnevenBatchesError(
                f"The ranks have different numbers of {stage} batches in dataloader {index}: {per_rank}."
                f" Under ZeRO-3 the rank with more would wait forever for the others in its next gather.{_FIX}"
            )


class EvenBatches:
    """An evaluation dataloader without a length, whose ranks agree before each batch that every rank has one, so they
    stop together: when some rank has run out while another has not, every rank raises :class:`UnevenBatchesError`
    naming how many batches each had, instead of the longer ones waiting forever in a gather."""

    def __init__(self, dataloader: Any, stage: str, gather: GatherFromRanks) -> None:
        self.dataloader, self.stage, self.gather = dataloader, stage, gather

    def __iter__(self) -> Iterator[Any]:
        count, batches = 0, iter(self.dataloader)
        while True:
            batch = next(batches, _END)
            every = self.gather(batch is not _END)  # one small collective per batch, beside a step's gathers
            if all(every):
                count += 1
                yield batch
            elif any(every):
                counts = {rank: f"{count + 1} or more" if has else str(count) for rank, has in enumerate(every)}
                raise UnevenBatchesError(
                    f"The ranks have different numbers of {self.stage} batches: {_per_rank(counts)}. Under ZeRO-3 the"
                    f" ranks with more would wait forever for the others in their next gather.{_FIX}"
                )
            else:
                return


_END = object()


def _per_rank(counts: Any) -> str:
    pairs = counts.items() if isinstance(counts, dict) else enumerate(counts)
    return ", ".join(f"rank {rank}: {count}" for rank, count in pairs)
