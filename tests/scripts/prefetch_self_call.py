"""Train a ``tests.models.AdapterModel`` (4 frozen layers; its ``training_step`` calls ``self(x)``, the usual Lightning
idiom) on N CPU processes, twice: as shipped, and with DeepSpeed's start-of-forward hook left as DeepSpeed installs
it (``forward_trace.reset_trace_at_outermost_call`` replaced by a no-op). Each rank writes ``<out>/<run>/rank<R>.json``.

Each gather of a param (``tests.gather_recording``) is stamped with its step and with how many frozen layers'
forwards began between its start and the wait on its work: above zero, DeepSpeed prefetched it while another
layer computed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from lightning_frozen.zero import (
    forward_trace,  # noqa: E402
    params,  # noqa: E402
)
from tests.distributed import write_report  # noqa: E402
from tests.gather_recording import GatherRecorder  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402

WIDTH, DEPTH = 128, 4


class StampSteps(Callback):
    def __init__(self, recorder: GatherRecorder) -> None:
        self.recorder = recorder

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.recorder.step = trainer.global_step


def fit(run: str, out: Path, devices: int, recorder: GatherRecorder) -> None:
    recorder.reset()
    model = AdapterModel(width=WIDTH, depth=DEPTH)
    for layer in model.layers:
        recorder.watch(layer.base)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), devices=devices, callbacks=[StampSteps(recorder)])
    trainer.fit(model, regression_data(width=WIDTH))
    report = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "gathers": recorder.gathers,
        "trainable": {n: params.full_param(p).tolist() for n, p in model.named_parameters() if p.requires_grad},
    }
    write_report(out / run, trainer.global_rank, report)
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    recorder = GatherRecorder()
    fit("shipped", out, args.devices, recorder)
    forward_trace.reset_trace_at_outermost_call = lambda module, offload: False
    fit("stock", out, args.devices, recorder)


if __name__ == "__main__":
    main()
