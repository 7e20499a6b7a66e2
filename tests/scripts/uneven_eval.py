"""Validate ``tests.models.AdapterModel`` on 2 CPU ranks with evaluation data of the user's own, which may give the
ranks different numbers of batches; the tests run it as a script.

Each case is a Trainer of its own in one world (starting the ranks costs more than a validation): ``sized`` (a sampler
of the user's, ``len`` known: rank 0 three batches, rank 1 two: rank 1 joins for the third), ``sized-refused`` (the
same, ``uneven_batches="raise"``), ``iterable`` (an ``IterableDataset`` without ``len``, the same counts),
``refused`` (the same, ``uneven_batches="raise"``) and ``even`` (an
``IterableDataset`` giving each rank two). Each rank writes ``<report>/<case>-rank<R>.txt``: ``ok <val_loss>`` (logged
with ``sync_dist=True``), or the ``UnevenBatchesError`` it raised.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from lightning_frozen.errors import UnevenBatchesError  # noqa: E402
from tests.models import AdapterModel, cpu_trainer  # noqa: E402

BATCH = 4
CASES = ("sized", "sized-refused", "iterable", "refused", "even")
SAMPLES = torch.randn(5 * BATCH, 32, generator=torch.Generator().manual_seed(0))


def batches_of_this_rank(case: str) -> int:
    rank = torch.distributed.get_rank()  # read once the ranks are set up, as Lightning asks for the data then
    return 2 if case == "even" else 3 - rank


class SyncedAdapter(AdapterModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)


class RankSampler(Sampler[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self)))

    def __len__(self) -> int:
        return batches_of_this_rank("sized") * BATCH


class RankStream(IterableDataset):
    def __init__(self, case: str) -> None:
        self.case = case

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(batches_of_this_rank(self.case) * BATCH):
            yield SAMPLES[index], SAMPLES[index, :1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    for case in CASES:
        validate(case, Path(args.report))


def validate(case: str, report: Path) -> None:
    if case.startswith("sized"):
        data = DataLoader(TensorDataset(SAMPLES, SAMPLES[:, :1]), batch_size=BATCH, sampler=RankSampler())
    else:
        data = DataLoader(RankStream(case), batch_size=BATCH)
    strategy = FrozenAwareDeepSpeedStrategy(uneven_batches="raise" if case.endswith("refused") else "join")
    trainer = cpu_trainer(strategy, devices=2, use_distributed_sampler=False)
    try:
        result = f"ok {trainer.validate(SyncedAdapter(), data, verbose=False)[0]['val_loss']:.7f}"
    except UnevenBatchesError as error:
        result = str(error)
    (report / f"{case}-rank{trainer.global_rank}.txt").write_text(result)


if __name__ == "__main__":
    main()
