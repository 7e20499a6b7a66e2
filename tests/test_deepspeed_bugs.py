"""Canaries: each test asserts that a DeepSpeed bug or limitation the seam works around (``zero/params.py``) is still
there in the installed DeepSpeed, and fails, naming the workaround to remove, once it is not. Written against DeepSpeed
0.19.8; docs/internals.md lists the workarounds with the DeepSpeed code each one goes around.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest

from tests.distributed import read_reports, run_script
from tests.models import AdapterModel, StockDeepSpeedOnCPU, cpu_trainer, regression_data


class _StateAtFirstStep(L.Callback):
    """Whether DeepSpeed's public getter finds Adam's ``exp_avg`` of the head's weight before and after the first
    step."""

    def __init__(self) -> None:
        self.found: dict[str, Any] = {}

    def _look(self, module: L.LightningModule, when: str) -> None:
        from deepspeed.utils import safe_get_full_optimizer_state

        try:
            self.found[when] = tuple(safe_get_full_optimizer_state(module.head.weight, "exp_avg").shape)
        except KeyError:
            self.found[when] = "KeyError"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._look(pl_module, "before the first step")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._look(pl_module, "after it")


def test_deepspeed_still_makes_the_optimizer_state_at_the_first_step() -> None:
    probe = _StateAtFirstStep()
    trainer = cpu_trainer(StockDeepSpeedOnCPU(stage=3), max_steps=1, callbacks=[probe])
    trainer.fit(AdapterModel(), regression_data())
    assert probe.found["after it"] == (1, 32)  # the getter, the key and the param are right
    assert probe.found["before the first step"] == "KeyError", (
        "DeepSpeed fixed the ZeRO-3 optimizer state missing before the first step (safe_set_full_optimizer_state"
        " raised KeyError): remove the workaround zero/params.ensure_optimizer_state (its step at learning rate 0"
        " through the private _optimizer_step) and its row in zero/private_names.py"
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of 2 ranks found writing one adapter's whole fp32 weight and Adam moment (tests/scripts)."""
    out = tmp_path_factory.mktemp("overrun")
    run_script("partition_overrun.py", f"--out={out}", timeout=400)
    reports = read_reports(Path(out) / "reports")
    assert [report["rank"] for report in reports] == [0, 1]
    assert [report["holds_padding"] for report in reports] == [False, True]
    return reports


@pytest.mark.slow
def test_the_package_writes_a_padded_partition_whole_and_exact(two_ranks: list[dict[str, Any]]) -> None:
    for report in two_ranks:
        failed = [key for key in ("padding_kept", "weight_read_back", "exp_avg_read_back") if not report[key]]
        assert not failed, f"rank {report['rank']}: {', '.join(failed)} false"  # named: pytest cuts a long dict short
    assert two_ranks[0]["gathered_to_writer"]


@pytest.mark.slow
def test_deepspeeds_full_setters_still_overrun_the_last_ranks_padded_partition(two_ranks: list[dict[str, Any]]) -> None:
    first, last = two_ranks
    assert not first["fp32_overran"] and not first["exp_avg_overran"]
    assert last["fp32_overran"] and last["exp_avg_overran"], (
        "DeepSpeed fixed safe_set_full_fp32_param / safe_set_full_optimizer_state on the last rank's padded"
        " partition (DeepSpeedZeroOptimizer_Stage3.set_full_hp_param narrowed past the value's end): remove the"
        " workaround zero/params._set_padded_partition and call them on every rank"
    )
