"""State that outlives one run: a Trainer reused across fit/validate/test/predict with other models. Nothing may answer
from the previous run: a base mismatch is caught every time, even when the other base has the same names and shapes.

(One strategy object given to a second Trainer is refused by Lightning's own accelerator connector before any of
this package runs: "CPU parallel_devices set through FrozenAwareDeepSpeedStrategy class, but accelerator set to ...".)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_frozen
from lightning_frozen import FrozenBaseMismatchError
from lightning_frozen.base.fingerprint import fingerprint_base
from tests.distributed import chained, read_reports, run_script
from tests.models import AdapterModel, cpu_trainer, regression_data


class Evaluated(AdapterModel):
    """``AdapterModel`` with test and predict steps."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self(batch[0]).float(), batch[1].float()))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def _frozen(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in module.named_parameters() if not p.requires_grad]


def _val_loss_without_deepspeed(checkpoint: Path) -> float:
    module = lightning_frozen.load_adapter(AdapterModel(), checkpoint)
    with torch.no_grad():
        losses = [nn.functional.mse_loss(module(x), y) for x, y in regression_data()]
    return float(torch.stack(losses).mean())


def test_one_trainer_fit_then_validate_test_predict_fit_with_other_models(tmp_path: Path) -> None:
    trainer = cpu_trainer(max_steps=3)
    trained = AdapterModel()
    trainer.fit(trained, regression_data())
    # validating the module just trained keeps its optimizer: a save afterwards still holds the optimizer state
    trainer.validate(trained, regression_data(), verbose=False)
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    assert sorted(torch.load(path, weights_only=True)["optimizer_states"][0]["state"]["head.weight"]) == [
        "exp_avg",
        "exp_avg_sq",
        "step",
    ]

    # another module on the same base loads the adapter (the fit's optimizer is not used for it)
    metrics = trainer.validate(AdapterModel(), regression_data(), ckpt_path=path, verbose=False)
    assert metrics[0]["val_loss"] == pytest.approx(_val_loss_without_deepspeed(path), rel=1e-5)

    # the same names and shapes over other values: refused by test, predict and fit alike
    for run in ("test", "predict", "fit"):
        other = Evaluated(seed=3)
        with pytest.raises(FrozenBaseMismatchError, match=r"`layers\.0\.base\.weight` holds different values"):
            getattr(trainer, run)(other, regression_data(), ckpt_path=path)

    # and the same Trainer still fits and saves the base it was given, not the first one's
    fresh = AdapterModel(seed=4)
    recorded = fingerprint_base(_frozen(fresh))
    trainer = cpu_trainer(max_steps=1)
    trainer.fit(AdapterModel(), regression_data())
    trainer.fit(fresh, regression_data())
    trainer.save_checkpoint(tmp_path / "fresh.ckpt")
    saved = torch.load(tmp_path / "fresh.ckpt", weights_only=True)["frozen_base"]["fingerprint"]
    assert saved["digest"] == recorded["digest"]


@pytest.fixture(scope="module")
def many_fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``many_fits.py`` in one fresh process: five fits, then two more, the second raising mid-forward."""
    tmp = tmp_path_factory.mktemp("many_fits")
    series = {"five": ("--fits", "5"), "raising": ("--fits", "2", "--raise-last")}
    run_script("many_fits.py", *chained(*[(str(tmp / name), *args) for name, args in series.items()]), timeout=400)
    return {name: read_reports(tmp / name)[0] for name in series}


def test_five_fits_in_one_process_keep_no_earlier_base_and_leave_no_function_replaced(
    many_fits: dict[str, dict[str, Any]],
) -> None:
    # a sweep or a notebook: a new Trainer and module per fit, each base 48 MiB; DeepSpeed kept every one of them
    report = many_fits["five"]
    assert report["alive"] == [[False] * 4] * 5  # module, engine, a frozen param and its shard: freed once dropped
    first, fifth = report["memory"][0], report["memory"][-1]
    assert fifth["uss"] < 1.1 * first["uss"] and fifth["rss"] < 1.1 * first["rss"], report["memory"]
    assert report["changed"] == []  # torch's, DeepSpeed's, transformers' and PEFT's functions are the originals


def test_a_fit_that_raises_mid_forward_releases_too(many_fits: dict[str, dict[str, Any]]) -> None:
    report = many_fits["raising"]
    assert report["raised"] == "raised mid-forward"
    assert report["alive"] == [[False] * 4] * 2
    assert report["memory"][-1]["uss"] < 1.1 * report["memory"][0]["uss"], report["memory"]
    assert report["changed"] == []
