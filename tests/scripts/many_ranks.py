"""Fit with ``ModelCheckpoint``, resume from its ``last.ckpt`` and validate from it, on several CPU ranks.

Run it once for Lightning's launcher (``--devices=2``), or once per simulated node with Lightning's environment
variables (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``) and ``--num-nodes=2 --devices=1``.
Each rank writes ``<dir>/rank<R>.json``. ``--fail=step`` makes ``--fail-rank`` raise in ``training_step``;
``--fail=hang`` makes it sleep there instead, so only the collective ``--timeout`` can end the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402


class Faulty(AdapterModel):
    def __init__(self, fail: str = "none", fail_rank: int = -1) -> None:
        super().__init__()
        self.fail, self.fail_rank = fail, fail_rank

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_rank == self.fail_rank and self.global_step == 2:
            if self.fail == "step":
                raise ValueError(f"training_step failed on rank {self.global_rank} on purpose")
            if self.fail == "hang":
                time.sleep(3600)
        return super().training_step(batch, batch_idx)


class MeetingFirst(FrozenAwareDeepSpeedStrategy):
    """With a short ``--timeout``: the ranks meet through files in ``<dir>/meeting`` before torch's rendezvous, which
    waits only that long for them to join. Lightning's launcher starts rank 1 as rank 0 reaches ``fit``, and rank 1
    then imports torch and Lightning: beside another test suite on 2 cores it joined past 10 s ("Timed out after 11
    seconds waiting for clients. 1/2 clients joined"), before the hang the test is about."""

    def __init__(self, meeting: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.meeting = meeting

    def setup_distributed(self) -> None:
        meeting = self.meeting
        meeting.mkdir(parents=True, exist_ok=True)
        rank = int(os.environ.get("NODE_RANK", "0")) * self.num_processes + int(os.environ.get("LOCAL_RANK", "0"))
        (meeting / f"rank{rank}").touch()
        deadline = time.monotonic() + 300
        while len(list(meeting.iterdir())) < self.num_processes * self.num_nodes and time.monotonic() < deadline:
            time.sleep(0.05)
        super().setup_distributed()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--fail", choices=["none", "step", "hang"], default="none")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--timeout", type=float, help="seconds a collective waits for the other ranks")
    args = parser.parse_args()
    folder = Path(args.dir)

    def trainer(max_epochs: int, **kwargs: Any) -> Any:
        timeout = {"timeout": timedelta(seconds=args.timeout)} if args.timeout else {}
        return cpu_trainer(
            MeetingFirst(folder / "meeting", **timeout) if args.timeout else FrozenAwareDeepSpeedStrategy(),
            devices=args.devices,
            num_nodes=args.num_nodes,
            max_epochs=max_epochs,
            **kwargs,
        )

    fit = trainer(1, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)], enable_checkpointing=True)
    fit.fit(Faulty(args.fail, args.fail_rank), regression_data())
    resume = trainer(2)
    resume.fit(AdapterModel(), regression_data(), ckpt_path=folder / "last.ckpt")
    resume.save_checkpoint(folder / "resumed.ckpt")
    metrics = trainer(1).validate(AdapterModel(), regression_data(), ckpt_path=folder / "resumed.ckpt")
    report = {
        "rank": fit.global_rank,
        "world_size": fit.world_size,
        "steps": [fit.global_step, resume.global_step],
        "val_loss": metrics[0]["val_loss"],
    }
    (folder / f"rank{fit.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
