"""What a run leaves behind: nothing of the package on the user's modules, on any class or module of torch,
Lightning, DeepSpeed, transformers or PEFT, or in the process, after ``fit``, ``validate``, ``test`` or ``predict``
returned or raised (``lightning_frozen/ledger.py``); and ``lightning_frozen.unshard`` makes the module an ordinary
one that ``torch.save`` and ``copy.deepcopy`` take, with the trained weights.

Each test snapshots the user's module and the libraries' bindings before the run (``tests/traces.py``) and compares
after it; a patch, hook, instance attribute or class attribute left in place fails it.
"""

from __future__ import annotations

import copy
import io
import signal
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import pytest
import torch
from torch import nn

import lightning_frozen
from lightning_frozen import FrozenAwareDeepSpeedStrategy
from tests.adapter_models import CausalAdapters, token_batches
from tests.models import AdapterModel, cpu_trainer, regression_data
from tests.peft_models import save_tiny_llama
from tests.traces import Snapshot, package_traces


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


def _strategy(frozen_dtype: Optional[str] = None) -> FrozenAwareDeepSpeedStrategy:
    return FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype)


def _unchanged(before: Snapshot, *models: nn.Module) -> None:
    """No library binding changed, and nothing of the package is on ``models``."""
    after = Snapshot.take(*models)
    rebound = [change for change in after.changes_since(before) if not change.startswith(tuple("0123456789"))]
    assert rebound == [], rebound
    for model in models:
        assert package_traces(model) == []


class Raising(AdapterModel):
    """Raises in its second training step, mid-forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trainer.global_step == 1:
            raise RuntimeError("the user's step failed")
        return super().forward(x)


class Evaluated(AdapterModel):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


# torch's own, as imported: a stock DeepSpeed run earlier in this worker (tests/stock_cpu.py) leaves `F.linear` replaced
before_linear = torch.nn.functional.linear


@pytest.fixture(autouse=True)
def _torchs_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from torch's own ``F.linear``, so that what it finds after the run is the run's doing."""
    monkeypatch.setattr(torch.nn.functional, "linear", before_linear)


@pytest.mark.parametrize("frozen_dtype", [None, "int8", "nf4", "bf16"])
def test_fit_validate_test_predict_leave_the_module_and_the_libraries_as_they_were(
    frozen_dtype: Optional[str], tmp_path: Path
) -> None:
    module = Evaluated()
    before = Snapshot.take(module)
    filters, handler = list(warnings.filters), signal.getsignal(signal.SIGTERM)
    trainer = cpu_trainer(strategy=_strategy(frozen_dtype), max_steps=3)
    trainer.fit(module, regression_data())
    _unchanged(before, module)
    assert signal.getsignal(signal.SIGTERM) == handler
    assert not any("lightning_frozen" in type(c).__module__ for c in trainer.callbacks)  # the run's callback went
    assert warnings.filters == filters
    assert torch.nn.functional.linear is before_linear
    for run in ("validate", "test", "predict"):
        getattr(trainer, run)(module, regression_data())
        _unchanged(before, module)

    # the documented call gives the shards whole: then the module is exactly the user's kind of module again
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    lightning_frozen.unshard(module)
    assert Snapshot.take(module).changes_since(before) == []
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    saved, copied = torch.load(buffer, weights_only=False), copy.deepcopy(module)
    reference = lightning_frozen.load_adapter(Evaluated(), tmp_path / "trained.ckpt")
    x = torch.randn(5, 32)
    with torch.no_grad():
        expected = reference(x)
        tolerance = dict(rtol=0, atol=0) if frozen_dtype is None else dict(rtol=0.2, atol=0.05)
        for model in (module, saved, copied):
            for name, value in reference.state_dict().items():
                if "lora" in name or name.startswith("head"):  # what trained: the same values
                    torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
            torch.testing.assert_close(model(x), expected, **tolerance)


def test_a_run_that_returns_ends_with_one_line_on_how_to_use_the_sharded_module(lightning_log: Any) -> None:
    module = Evaluated()
    cpu_trainer(max_steps=2).fit(module, regression_data())

    notices = [line for line in lightning_log.lines if "still ZeRO-3 shards" in line]
    assert len(notices) == 1 and "`lightning_frozen.unshard(model)` on every rank" in notices[0]
    assert "`lightning_frozen.load_from_checkpoint(Evaluated, path)`" in notices[0]
    with pytest.raises(RuntimeError, match="mat2 must be a matrix"), torch.no_grad():
        module(torch.randn(2, 32))  # a linear layer's error; an embedding's is "'weight' must be 2-D" (docs/faq.md)
    lightning_frozen.unshard(module)
    assert lightning_frozen.zero.whole.still_sharded_notice(module) is None

    lightning_log.lines.clear()
    with pytest.raises(RuntimeError, match="the user's step failed"):
        cpu_trainer(max_steps=3).fit(Raising(), regression_data())
    assert not [line for line in lightning_log.lines if "still ZeRO-3 shards" in line]  # the error speaks alone


def test_a_fit_that_raises_mid_step_leaves_nothing(tmp_path: Path) -> None:
    module = Raising()
    before = Snapshot.take(module)
    with pytest.raises(RuntimeError, match="the user's step failed"):
        cpu_trainer(strategy=_strategy("nf4"), max_steps=3).fit(module, regression_data())
    _unchanged(before, module)
    assert torch.nn.functional.linear is before_linear


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_peft_fits_from_a_folder_leave_peft_and_transformers_unpatched(llama_folder: str, checkpointing: bool) -> None:
    import peft

    init = peft.PeftModel.__init__
    before = Snapshot.take()
    for _ in range(2):  # a notebook's second fit once met the first one's wrappers
        module = CausalAdapters(llama_folder, ["x", "y"], in_configure_model=True, checkpointing=checkpointing)
        cpu_trainer(strategy=_strategy(), max_steps=2).fit(module, token_batches(samples=8))
        _unchanged(before, module)
    assert peft.PeftModel.__init__ is init


def test_a_module_the_user_gave_its_own_instance_forward_keeps_it() -> None:
    module = AdapterModel()
    own = module.forward
    module.forward = own  # e.g. a user's wrapper set on the instance before the run
    cpu_trainer(strategy=_strategy("nf4"), max_steps=1).fit(module, regression_data())
    assert vars(module)["forward"] is own


def test_two_fits_in_one_process_leave_one_strategy_callback_at_most() -> None:
    trainer: L.Trainer = cpu_trainer(strategy=_strategy(), max_steps=1)
    for _ in range(2):
        trainer.fit(AdapterModel(), regression_data())
        assert [type(c).__name__ for c in trainer.callbacks if "lightning_frozen" in type(c).__module__] == []
