"""Lightning callbacks the studies measure a fit with (this module imports Lightning; ``launch`` and ``records`` do
not, so a study's driver process stays light)."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import Callback

from benchmarks.harness.probes import count_gathered_bytes


class StepMeter(Callback):
    """Each training batch's wall time (``step_seconds``) and the bytes ZeRO-3 all-gathered during it
    (``step_bytes``), counted from construction on (:func:`probes.count_gathered_bytes`)."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self.step_bytes: list[int] = []
        self._gathered = {"bytes": 0}
        count_gathered_bytes(self._gathered)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._started, self._bytes_before = time.perf_counter(), self._gathered["bytes"]

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_seconds.append(time.perf_counter() - self._started)
        self.step_bytes.append(self._gathered["bytes"] - self._bytes_before)
