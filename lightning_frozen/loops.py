"""Lightning's loops where ZeRO-3 or a resume needs more of them: data that runs out on some ranks before others
(:func:`even_dataloader`, :class:`AgreedBatches`: the ranks that ran out serve the others on stand-in batches, weighed
by :class:`Joining`, or every rank raises :class:`UnevenBatchesError`; docs/loops.md), and the fit loop after a resume,
whose next epoch Lightning 2.6 counts as the restarted one (:func:`start_next_epoch_afresh`, docs/checkpoints.md).
"""

from __future__ import annotations

import inspect
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional

import torch
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


def even_dataloader(
    dataloader: object, trainer: Any, world_size: int, joining: Joining, gather: Optional[GatherFromRanks] = None
) -> object:
    """``dataloader`` as Lightning gave it where every rank has as many batches, else wrapped in :class:`AgreedBatches`
    (a strategy's ``process_dataloader``). The ranks compare their lengths (one small all-gather per dataloader set
    up): lengths that differ are known from here on, and a dataloader without a length is agreed batch by batch; with
    ``joining.refuse`` lengths that differ raise :class:`UnevenBatchesError` on every rank. Collective."""
    stage = trainer.state.stage
    if world_size == 1 or stage is None:
        return dataloader
    prefix = str(stage.dataloader_prefix)
    gather = gather or gather_objects
    lengths = gather(length(dataloader))
    if None not in lengths and len(set(lengths)) == 1:
        return dataloader
    known = None if None in lengths else lengths
    if known is not None and joining.refuse:
        raise _uneven(prefix, dict(enumerate(known)))
    joining.forget(prefix)  # the steps of this stage's loaders fetched before are not run any more
    wrapper = AgreedBatches if known is None else SizedAgreedBatches
    return wrapper(dataloader, prefix, joining, trainer.global_rank, gather, known)


def length(dataloader: object) -> Optional[int]:
    """``dataloader``'s number of batches, or None where it has none (a ``DataLoader`` over an ``IterableDataset``)."""
    try:
        return len(dataloader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


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

    def summary(self, world_size: int) -> str:
        """A sentence for the summary at the start of a run: what uneven data meets ("" on one rank)."""
        if world_size == 1:
            return ""
        if self.refuse:
            return " Uneven batches: raise (every rank raises UnevenBatchesError where ranks have different numbers)."
        return (
            " Uneven batches: join (a rank that runs out of batches before the others serves them on stand-in steps"
            ' that count for nothing; `uneven_batches="raise"` refuses such data; docs/loops.md).'
        )

    def tell_once(self, stage: str, counts: dict[int, Any], every: Sequence[bool]) -> None:
        """Say on rank 0, the first time a rank of ``stage`` runs out while others have not, what happens."""
        if stage in self._told:
            return
        self._told.add(stage)
        out = [rank for rank, has in enumerate(every) if not has]
        averaged = ", and each step's gradient is the mean over the ranks that have a batch" if stage == "train" else ""
        rank_zero_info(
            f"lightning-frozen: rank{'s' * (len(out) > 1)} {', '.join(map(str, out))} ran out of {stage} batches"
            f" ({_per_rank(counts)}). Until every rank has, a rank without data runs the same steps on a stand-in"
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
    """A dataloader whose ranks may have different numbers of batches. With every rank's ``lengths`` known
    (:class:`SizedAgreedBatches`) each rank knows which have a batch at each step; without, the ranks agree before each
    batch which of them still have one (one small collective per batch). The loop ends when every rank has run out.
    Until then a rank that ran out yields a stand-in (its last batch, or, having had none, the first rank's with data),
    recorded as such in the :class:`Joining`; with ``joining.refuse`` every rank raises :class:`UnevenBatchesError`
    with the counts instead. Other attributes are the dataloader's."""

    def __init__(
        self,
        dataloader: Any,
        stage: str,
        joining: Joining,
        rank: int,
        gather: Optional[GatherFromRanks] = None,
        lengths: Optional[Sequence[int]] = None,
    ) -> None:
        self.dataloader, self.stage, self.joining, self.rank = dataloader, stage, joining, rank
        self.gather, self.lengths = gather or gather_objects, lengths

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __iter__(self) -> Iterator[Any]:
        self.joining.forget(self.stage, self)
        last, batches, counts, lengths = _END, iter(self.dataloader), None, self.lengths
        for index in itertools.count():
            batch = next(batches, _END) if lengths is None or index < lengths[self.rank] else _END
            has = batch is not _END
            if lengths is None:
                every = self.gather((has, not has and last is _END))  # a small collective, beside a step's gathers
                having, needs = [rank_has for rank_has, _ in every], any(needs for _, needs in every)
            else:
                having, needs = [index < count for count in lengths], index == 0 and 0 in lengths
            counts = counts or [0] * len(having)
            if not any(having):
                return
            if all(having):
                counts = [count + 1 for count in counts]
                self.joining.fetched(self.stage, self, None)
                last = batch
                yield batch
                continue
            so_far = dict(enumerate(lengths)) if lengths is not None else _so_far(counts, having)
            if self.joining.refuse:
                raise _uneven(self.stage, so_far)
            self.joining.tell_once(self.stage, so_far, having)
            if needs:  # a rank that had no batch at all: the first rank's with one
                source = having.index(True)
                given = self.gather(batch if self.rank == source else None)[source]
                last = given if last is _END else last
            counts = [count + rank_has for count, rank_has in zip(counts, having)]
            self.joining.fetched(self.stage, self, Share(sum(having), len(having), not has))
            last = batch if has else last
            yield last


class SizedAgreedBatches(AgreedBatches):
    """:class:`AgreedBatches` with every rank's ``lengths``, as long as the longest on every rank: Lightning's epoch
    end, ``limit_*_batches`` and progress bars count the same steps on each."""

    def __len__(self) -> int:
        return max(self.lengths or [0])


def _so_far(counts: Sequence[int], having: Sequence[bool]) -> dict[int, str]:
    return {
        rank: f"{count + 1} or more" if has else str(count) for rank, (has, count) in enumerate(zip(having, counts))
    }


def _uneven(stage: str, counts: dict[int, Any]) -> UnevenBatchesError:
    return UnevenBatchesError(
        f"The ranks have different numbers of {stage} batches: {_per_rank(counts)}. Under ZeRO-3 the ranks with more"
        f" would wait forever for the others in their next gather.{_FIX}"
    )


_END = object()


def _per_rank(counts: Any) -> str:
    pairs = counts.items() if isinstance(counts, dict) else enumerate(counts)
    return ", ".join(f"rank {rank}: {count}" for rank, count in pairs)
