"""Uneven data over 2 ranks (issue 60, docs/loops.md): a stream split unevenly against the same batches evened out by
hand, and what joining costs where the data is even.

    python benchmarks/uneven/run.py [--batches 100] [--repeats 2] [--out benchmarks/uneven/results]

One launch of 2 CPU ranks (one thread each) fits, in one world, a Trainer per configuration, each ``--repeats``
times, interleaved: a frozen stack of 4 linear layers of width 512 with a LoRA adapter (r=8) on each, SGD, batches of
16, fp32, ``frozen_deepspeed``. The same ``--batches`` batches each time, split:

- ``uneven stream``: an ``IterableDataset`` (no length) giving rank 0 the first 60 % and rank 1 the rest: rank 1 runs
  out and serves on stand-ins for the last 20 % of the steps (``uneven_batches="join"``);
- ``evened stream``: the same batches, half to each rank by hand (``join``; no rank runs out, each batch agreed);
- ``even stream, raise``: the same with ``uneven_batches="raise"``;
- ``even sized, join`` / ``raise``: the halves as a map-style dataset (the loader has a length): nothing is wrapped.

Wall time: ``trainer.fit`` on rank 0, between barriers. Per step: the time from one ``on_train_batch_end`` to the
next (fetch, agreement and step), split by whether some rank had run out in it (a joined step) or not. Writes
``<out>/uneven.json`` and ``<out>/uneven.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

WIDTH, DEPTH, RANK, BATCH = 512, 4, 8, 16
CONFIGS = (  # name, loader, share of the batches rank 0 gets, uneven_batches
    ("uneven stream", "stream", 0.6, "join"),
    ("evened stream", "stream", 0.5, "join"),
    ("even stream, raise", "stream", 0.5, "raise"),
    ("even sized, join", "sized", 0.5, "join"),
    ("even sized, raise", "sized", 0.5, "raise"),
)


def worker(batches: int, repeats: int, out: Path) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Dataset, IterableDataset

    from lightning_frozen import FrozenAwareDeepSpeedStrategy
    from tests.models import AdapterModel

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(BATCH, WIDTH, generator=generator) for _ in range(batches)]
    data = [(x, x[:, :1] * 0.5 - x[:, 1:2]) for x in data]

    def rank_batches(share: float) -> list[Any]:
        split = round(batches * share)
        return data[:split] if torch.distributed.get_rank() == 0 else data[split:]

    class Stream(IterableDataset):
        def __init__(self, share: float) -> None:
            self.share = share

        def __iter__(self) -> Any:
            return iter(rank_batches(self.share))

    class Sized(Dataset):
        def __init__(self, share: float) -> None:
            self.share = share

        def __len__(self) -> int:
            return len(rank_batches(self.share))

        def __getitem__(self, index: int) -> Any:
            return rank_batches(self.share)[index]

    class SGDModel(AdapterModel):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.last, self.times = None, {"real": [], "joined": []}

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.times["real" if trainer.strategy._joining.share is None else "joined"].append(now - self.last)
            self.last = now

    def fit(loader: str, share: float, uneven: str, count: int) -> dict[str, Any]:
        dataset = Stream(share) if loader == "stream" else Sized(share)
        times = StepTimes()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=FrozenAwareDeepSpeedStrategy(uneven_batches=uneven),
            max_epochs=1,
            limit_train_batches=count,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            callbacks=[times],
        )
        model = SGDModel(width=WIDTH, depth=DEPTH, rank=RANK)
        if torch.distributed.is_initialized():  # not before the warm-up's fit
            torch.distributed.barrier()
        begun = time.perf_counter()
        trainer.fit(model, DataLoader(dataset, batch_size=None))
        torch.distributed.barrier()
        wall = time.perf_counter() - begun
        return {"wall_s": wall, "steps": trainer.global_step, **times.times}

    fit("stream", 0.5, "join", 4)  # warm-up: the first fit of a process builds and imports more
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in CONFIGS}
    for _ in range(repeats):
        for name, loader, share, uneven in CONFIGS:
            results[name].append(fit(loader, share, uneven, batches))
    if torch.distributed.get_rank() == 0:
        (out / "uneven.json").write_text(json.dumps(results, indent=1))


def median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values) if values else float("nan")


def report(out: Path, batches: int, repeats: int) -> str:
    from benchmarks.harness.probes import cpu_model, load_average
    from benchmarks.harness.records import git_commit, now_utc

    results = json.loads((out / "uneven.json").read_text())
    walls = {name: min(run["wall_s"] for run in runs) for name, runs in results.items()}
    lines = [
        f"{now_utc()}, commit {git_commit()}, {cpu_model()}, load {load_average()}, {batches} batches, best of"
        f" {repeats}",
        "",
        "| configuration | steps | wall s (best) | ratio | median ms / all-real step | median ms / joined step |",
        "|---|---|---|---|---|---|",
    ]
    base = walls["evened stream"]
    for name, runs in results.items():
        real = [time for run in runs for time in run["real"]]
        joined = [time for run in runs for time in run["joined"]]
        lines.append(
            f"| {name} | {runs[0]['steps']} | {walls[name]:.2f} | {walls[name] / base:.2f}x |"
            f" {median_ms(real):.1f} | {median_ms(joined):.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.batches, args.repeats, args.out)
        return
    command = [sys.executable, __file__, "--worker", f"--batches={args.batches}", f"--repeats={args.repeats}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    subprocess.run([*command, f"--out={args.out}"], check=True, env=environment)
    table = report(args.out, args.batches, args.repeats)
    (args.out / "uneven.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
