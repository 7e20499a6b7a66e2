"""Train ``tests.models.AdapterModel`` with SGD on 2 or 4 CPU ranks from data that gives the ranks different numbers
of batches; the tests run it as a script and check the weights against plain torch (tests/test_uneven.py).

Each case is a Trainer of its own in one world (starting the ranks costs more than a fit): ``3-1`` (rank 0 three
batches of 4 samples, rank 1 one, from an ``IterableDataset`` batched by the DataLoader), ``3-0`` (rank 1 none, a
stream of whole batches under ``DataLoader(batch_size=None)``), ``sized`` (``3-1`` from a map-style dataset through a
sampler of the user's own: the loader has a length), ``nf4`` and ``int8`` (``3-1`` over a frozen base stored so),
``adapters`` (``3-1`` of token batches, two LoRA adapters trained at once on the tiny Llama of ``--llama``),
``four`` and ``four-sized`` (a stream and ``sized`` on 4 ranks: one batch, none, three, two; a launch of their own),
``nodes`` (``3-1`` on 2 simulated nodes of one rank each, ``--num-nodes=2``: a launch per node),
``accumulate`` (four batches and one, ``accumulate_grad_batches=2``: two optimizer steps of two micro-batches each),
``predict`` (``3-1`` predicted, not trained), ``preempt`` (``3-1``, and rank 1 sends itself SIGTERM in its stand-in's
step at global step 1: the process exits, so it comes last) and ``resume`` (``3-1`` resumed from the ``last.ckpt``
that ``preempt`` left, in a launch of its own). Each rank writes ``<report>/<case>/rank<R>.json``: its exit status,
global step, the trainable params gathered whole, the epoch's logged means and sums and (rank 0) what the run said;
``predict``, what it predicted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from lightning_frozen.adapters import adapter_param_groups  # noqa: E402
from tests.adapter_models import CausalAdapters, token_batches  # noqa: E402
from tests.distributed import logged_lines, write_report  # noqa: E402
from tests.models import AdapterModel, cpu_trainer  # noqa: E402

BATCH, LR = 4, 0.5
CASES = {
    "3-1": (3, 1),
    "3-0": (3, 0),
    "sized": (3, 1),
    "nf4": (3, 1),
    "int8": (3, 1),
    "adapters": (3, 1),
    "nodes": (3, 1),
    "accumulate": (4, 1),
    "four": (1, 0, 3, 2),
    "four-sized": (1, 0, 3, 2),
    "predict": (3, 1),
    "preempt": (3, 1),
    "resume": (3, 1),
}  # the batches of each rank
SIZED = ("sized", "four-sized")  # a map-style dataset through a sampler of the user's own: the loader has a length
ADAPTERS = ["x", "y"]  # the ``adapters`` case's, trained at once on the tiny Llama (tests/adapter_models.py)
SAMPLES = torch.randn(8 * BATCH, 32, generator=torch.Generator().manual_seed(0))
TARGETS = SAMPLES[:, :1] * 0.5 - SAMPLES[:, 1:2]
TOKENS = token_batches(samples=8 * BATCH).dataset.tensors  # type: ignore[attr-defined]


def batches_of(case: str, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches in ``case``: the next ones of SAMPLES after the ranks before it."""
    first = sum(CASES[case][:rank])
    x, y = TOKENS if case == "adapters" else (SAMPLES, TARGETS)
    return [
        (x[index * BATCH : (index + 1) * BATCH], y[index * BATCH : (index + 1) * BATCH])
        for index in range(first, first + CASES[case][rank])
    ]


class RankStream(IterableDataset):
    """This rank's batches: whole (``batched``), or one sample at a time for the DataLoader to batch."""

    def __init__(self, case: str, batched: bool) -> None:
        self.case, self.batched = case, batched

    def __iter__(self) -> Iterator[Any]:
        for x, y in batches_of(self.case, torch.distributed.get_rank()):
            yield from [(x, y)] if self.batched else zip(x, y)


class RankSampler(Sampler[int]):
    """This rank's samples of SAMPLES, the same as its stream's, with a length."""

    def __init__(self, case: str) -> None:
        self.case = case

    def __iter__(self) -> Iterator[int]:
        rank = torch.distributed.get_rank()
        first = sum(CASES[self.case][:rank]) * BATCH
        return iter(range(first, first + len(self)))

    def __len__(self) -> int:
        return CASES[self.case][torch.distributed.get_rank()] * BATCH


class SGDAdapter(AdapterModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_mean", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("samples", float(len(x)), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([param for param in self.parameters() if param.requires_grad], lr=LR)


class SGDAdapters(CausalAdapters):
    """``ADAPTERS`` trained at once, each with SGD in a param group of its own."""

    def __init__(self, llama_folder: str) -> None:
        super().__init__(llama_folder, ADAPTERS)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(adapter_param_groups(self, {name: {} for name in ADAPTERS}), lr=LR)


class Preempted(SGDAdapter):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        share = self.trainer.strategy._joining.share  # this step's: a stand-in where `joined`
        if self.global_rank == 1 and self.global_step == 1 and share is not None and share.joined:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--cases", default="3-1,3-0,sized,nf4,int8,adapters,accumulate,predict,preempt")
    parser.add_argument("--llama", help="the tiny Llama's folder, for the ``adapters`` case")
    parser.add_argument("--num-nodes", type=int, default=1, help="simulated nodes, each started with its NODE_RANK")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # SIGTERM's default before the strategy's handler
    for case in args.cases.split(","):
        train(case, Path(args.report), args.llama, args.num_nodes)


def train(case: str, folder: Path, llama: str, num_nodes: int = 1) -> None:
    batched, report = case == "3-0", folder / case
    if case in SIZED:
        data = DataLoader(TensorDataset(SAMPLES, TARGETS), batch_size=BATCH, sampler=RankSampler(case))
    else:
        data = DataLoader(RankStream(case, batched), batch_size=None if batched else BATCH)
    model = Preempted() if case == "preempt" else SGDAdapters(llama) if case == "adapters" else SGDAdapter()
    trainer = cpu_trainer(
        FrozenAwareDeepSpeedStrategy(frozen_dtype=case if case in ("nf4", "int8") else None),
        devices=len(CASES[case]) // num_nodes,
        num_nodes=num_nodes,
        accumulate_grad_batches=2 if case == "accumulate" else 1,
        use_distributed_sampler=False,
        default_root_dir=folder,
    )
    resume = folder / "last.ckpt" if case == "resume" else None
    if case == "predict":
        predicted = trainer.predict(model, data)
        rows = [None if batch is None else batch.tolist() for batch in predicted]
        write_report(report, trainer.global_rank, {"predicted": rows})
        return
    try:
        with logged_lines() as lines:
            trainer.fit(model, data, ckpt_path=resume)
    except SystemExit as stop:
        write_report(report, trainer.global_rank, {"status": stop.code, "global_step": trainer.global_step})
        raise
    params = {
        name: safe_get_full_fp32_param(param).tolist()
        for name, param in model.named_parameters()
        if param.requires_grad
    }
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    write_report(
        report,
        trainer.global_rank,
        {"status": 0, "global_step": trainer.global_step, "params": params, "metrics": metrics, "said": lines.text},
    )
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
