"""Lightning's loops where ZeRO-3 or a resume needs more of them: evaluation data that every rank has as much of
(:func:`check_even_batches`, :class:`EvenBatches`: a rank with one more batch would hang in its gather; both raise
:class:`UnevenBatchesError` on every rank at once, docs/loops.md), and the fit loop after a resume, whose next epoch
Lightning 2.6 counts as the restarted one (:func:`start_next_epoch_afresh`, docs/checkpoints.md).
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional

import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info

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


def even_dataloader(dataloader: object, trainer: Any, world_size: int, joining: Joining) -> object:
    """``dataloader`` as Lightning gave it, or, on several ranks without a length, wrapped in :class:`AgreedBatches`
    (a strategy's ``process_dataloader``): a dataloader with a length costs nothing more."""
    stage = trainer.state.stage
    if world_size == 1 or stage is None or has_length(dataloader):
        return dataloader
    prefix = str(stage.dataloader_prefix)
    joining.forget(prefix)  # the steps of this stage's loaders fetched before are not run any more
    return AgreedBatches(dataloader, prefix, joining, trainer.global_rank)


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


class Share(NamedTuple):
    """One step's batches where some rank has run out: ``real`` of the ``world`` ranks have one of their own; this
    rank's is a stand-in when ``joined``."""

    real: int
    world: int
    joined: bool

    @property
    def loss_weight(self) -> float:
        """What this rank's loss is multiplied by before its backward: 0 for a stand-in, else ``world / real``. ZeRO
        averages the gradients over the ``world`` ranks, so the step's gradient is the mean over the real batches."""
        return 0.0 if self.joined else self.world / self.real


class Joining:
    """A run's ranks that ran out of data and keep serving the others (docs/loops.md). :class:`AgreedBatches` records
    each batch's :class:`Share` as it is fetched (Lightning fetches one ahead); the strategy's steps take them in that
    order (:meth:`step`), and its backward weighs the loss by the running step's (:meth:`weighed`). Where every rank
    has a batch, or a loader has a length, the share is None and nothing changes."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse  # `uneven_batches="raise"`: every rank raises UnevenBatchesError instead
        self.share: Optional[Share] = None  # the running step's
        self._fetched: dict[str, deque[tuple[object, Optional[Share]]]] = {}  # per stage: (loader, share), in order
        self._told: set[str] = set()  # the stages whose first join was said

    def fetched(self, stage: str, loader: object, share: Optional[Share]) -> None:
        self._fetched.setdefault(stage, deque()).append((loader, share))

    def forget(self, stage: str, loader: Optional[object] = None) -> None:
        """Drop the shares of ``stage`` fetched and never stepped (a loop stopped early): ``loader``'s, or all."""
        queue = self._fetched.get(stage)
        if queue:
            self._fetched[stage] = deque(entry for entry in queue if loader is not None and entry[0] is not loader)

    @contextmanager
    def step(self, stage: str, module: Any) -> Iterator[Optional[Share]]:
        """The step of ``stage``'s next batch; on a stand-in, ``module.log`` logs weightless (:func:`weightless`)."""
        queue = self._fetched.get(stage)
        self.share = share = queue.popleft()[1] if queue else None
        if share is None or not share.joined:
            yield share
            return
        module.log = weightless(module.log)  # an instance attribute over the class's method, removed after
        try:
            yield share
        finally:
            vars(module).pop("log", None)

    def weighed(self, loss: Any) -> Any:
        """``loss`` for the running step's backward: as it is where every rank has a batch, else times its weight."""
        return loss if self.share is None else loss * self.share.loss_weight

    def tell_once(self, stage: str, counts: Sequence[int], every: Sequence[bool]) -> None:
        """Say on rank 0, the first time a rank of ``stage`` runs out while others have not, what happens."""
        if stage in self._told:
            return
        self._told.add(stage)
        out = [rank for rank, has in enumerate(every) if not has]
        so_far = {rank: f"{count + 1} or more" if every[rank] else str(count) for rank, count in enumerate(counts)}
        averaged = ", and each step's gradient is the mean over the ranks that have a batch" if stage == "train" else ""
        rank_zero_info(
            f"lightning-frozen: rank{'s' * (len(out) > 1)} {', '.join(map(str, out))} ran out of {stage} batches"
            f" ({_per_rank(so_far)}). Until every rank has, a rank without data runs the same steps on a stand-in"
            f" batch (its last one, or another rank's), which counts for nothing: its loss is weighed 0 and what it"
            f" logs is left out of epoch means{averaged} ({sum(every)} of {len(every)} now). Pass"
            ' `uneven_batches="raise"` to the strategy to refuse uneven data instead (docs/loops.md).'
        )


def weightless(log: Callable[..., Any]) -> Callable[..., Any]:
    """``LightningModule.log`` (bound) for a stand-in's step: a value averaged over the epoch counts with batch size
    0, a summed one as 0; anything else as given (a ``Metric``, whose state the step updated; ``max``/``min``)."""
    signature = inspect.signature(log)

    def log_weightless(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(name, value, *args, **kwargs)
        reduce = bound.arguments.get("reduce_fx", "mean")
        if isinstance(value, (torch.Tensor, int, float)):
            if reduce in ("mean", torch.mean):
                bound.arguments["batch_size"] = 0
            elif reduce in ("sum", torch.sum):
                return log(name, torch.zeros_like(torch.as_tensor(value, dtype=torch.float32)), *args, **kwargs)
        return log(*bound.args, **bound.kwargs)

    return log_weightless


class AgreedBatches:
    """A dataloader without a length on several ranks, whose ranks agree before each batch which of them still have
    one (one small collective per batch). The loop ends when every rank has run out. Until then a rank that ran out
    yields a stand-in (its last batch, or, having had none, the first rank's with data), recorded as such in the
    :class:`Joining`; with ``joining.refuse`` every rank raises :class:`UnevenBatchesError` with the counts instead.
    Other attributes are the dataloader's."""

    def __init__(
        self, dataloader: Any, stage: str, joining: Joining, rank: int, gather: Optional[GatherFromRanks] = None
    ) -> None:
        self.dataloader, self.stage, self.joining, self.rank = dataloader, stage, joining, rank
        self.gather = gather or gather_objects

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __iter__(self) -> Iterator[Any]:
        self.joining.forget(self.stage, self)
        last, batches, counts = _END, iter(self.dataloader), None
        while True:
            batch = next(batches, _END)
            has = batch is not _END
            every = self.gather(
                (has, not has and last is _END)
            )  # a small collective per batch, beside a step's gathers
            having = [rank_has for rank_has, _ in every]
            counts = counts or [0] * len(every)
            if not any(having):
                return
            if all(having):
                counts = [count + 1 for count in counts]
                self.joining.fetched(self.stage, self, None)
                last = batch
                yield batch
                continue
            if self.joining.refuse:
                so_far = {
                    rank: f"{count + 1} or more" if has else str(count)
                    for rank, (has, count) in enumerate(zip(having, counts))
                }
                raise UnevenBatchesError(
                    f"The ranks have different numbers of {self.stage} batches: {_per_rank(so_far)}. Under ZeRO-3 the"
                    f" ranks with more would wait forever for the others in their next gather.{_FIX}"
                )
            self.joining.tell_once(self.stage, counts, having)
            if any(needs for _, needs in every):  # a rank that had no batch at all: the first rank's with one
                source = having.index(True)
                given = self.gather(batch if self.rank == source else None)[source]
                last = given if last is _END else last
            counts = [count + rank_has for count, rank_has in zip(counts, having)]
            self.joining.fetched(self.stage, self, Share(sum(having), len(having), not has))
            last = batch if has else last
            yield last


_END = object()


def _per_rank(counts: Any) -> str:
    pairs = counts.items() if isinstance(counts, dict) else enumerate(counts)
    return ", ".join(f"rank {rank}: {count}" for rank, count in pairs)
