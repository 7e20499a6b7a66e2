"""Start a world and train one step on it: ``<devices>`` ranks through Lightning's launcher, on the ``MASTER_PORT``
the environment holds, or on the one the strategy chooses where it holds none. Rank 0 writes ``<dir>/rank0.json``
with the port its world met on. In a test's own process (``tests/distributed.run_in_this_process``): a notebook's
in-process run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402


class ReportPort(L.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            write_report(self.folder, 0, {"port": int(os.environ["MASTER_PORT"]), "world_size": trainer.world_size})


if __name__ == "__main__":
    folder, devices = Path(sys.argv[1]), int(sys.argv[2])
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), devices=devices, max_steps=1, callbacks=[ReportPort(folder)])
    trainer.fit(AdapterModel(), regression_data())
