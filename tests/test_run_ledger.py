"""What a run leaves behind: nothing of the package on the user's modules, on any class or module of torch,
Lightning, DeepSpeed, transformers or PEFT, or in the process, after ``fit``, ``validate``, ``test`` or ``predict``
returned or raised (``lightning_frozen/ledger.py``); and ``lightning_frozen.unshard`` makes the module an ordinary
one that ``torch.save`` and ``copy.deepcopy`` take, with the trained weights.

Each test snapshots the user's module, the libraries' bindings and the object-valued globals of the libraries and of
the package before the run (``tests/traces.py``) and compares after it; a patch, hook, instance attribute, class
attribute, process-wide object (DeepSpeed's accelerator, transformers' ``HfDeepSpeedConfig`` reference) or table of the
package's left in place fails it. The compute tables are the run's own (its compute object's) and empty after it.
"""

from __future__ import annotations

import copy
import io
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import pytest
import torch
from torch import nn

import lightning_frozen
from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.zero.compute import waiting_threads
from tests.adapter_models import CausalAdapters, token_batches
from tests.models import AdapterModel, cpu_trainer, regression_data
from tests.peft_models import save_tiny_llama
from tests.traces import Snapshot, package_traces


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


def _strategy(frozen_dtype: Optional[str] = None) -> FrozenAwareDeepSpeedStrategy:
    return FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype)


def _unchanged(before: Snapshot, *models: nn.Module, trainer: Optional[L.Trainer] = None) -> None:
    """No library binding or global object changed, nothing of the package is on ``models``, and the compute tables of
    ``trainer``'s last run hold nothing."""
    after = Snapshot.take(*models)
    rebound = [change for change in after.changes_since(before) if not change.startswith(tuple("0123456789"))]
    assert rebound == [], rebound
    for model in models:
        assert package_traces(model) == []
    if trainer is not None:
        tables = trainer.strategy._compute.tables
        layers, buffers = tables.layers, tables.buffers
        assert not (layers._coded or layers._gathered or layers._layers or layers._tiles), vars(layers)
        assert buffers.bytes_kept == 0 and buffers.take(1, torch.float32, asker=0) is None  # closed


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
    _unchanged(before, module, trainer=trainer)
    assert signal.getsignal(signal.SIGTERM) == handler
    assert not any("lightning_frozen" in type(c).__module__ for c in trainer.callbacks)  # the run's callback went
    assert warnings.filters == filters
    assert torch.nn.functional.linear is before_linear
    for run in ("validate", "test", "predict"):
        getattr(trainer, run)(module, regression_data())
        _unchanged(before, module, trainer=trainer)

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
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # no filter at all: a FutureWarning shows, as in a user's script
        lightning_frozen.unshard(module)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]  # torch's, at DeepSpeed's gathers
    assert warnings.filters == filters
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


def test_what_a_stock_zero_init_left_on_classes_stays_as_it_was(llama_folder: str) -> None:
    # a stock DeepSpeed run earlier in the process leaves `_old_init` on every module class it saw (a full suite's
    # worker met it); the run's own zero.Init rebinds it, and the run must put the earlier value back
    import peft

    stale = peft.PeftModel.__init__
    peft.PeftModel._old_init = stale
    try:
        before = Snapshot.take()
        module = CausalAdapters(llama_folder, ["x"], in_configure_model=True)
        cpu_trainer(strategy=_strategy(), max_steps=1).fit(module, token_batches(samples=4))
        _unchanged(before, module)
        assert vars(peft.PeftModel)["_old_init"] is stale
    finally:
        del peft.PeftModel._old_init


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


class _RecordsTheBelief(CausalAdapters):
    """Records, where transformers asks, whether it believes ZeRO-3 is on (every `from_pretrained` then builds under
    `zero.Init`) and which DeepSpeed accelerator runs."""

    seen: dict[str, Any]

    def configure_model(self) -> None:
        from transformers.integrations import is_deepspeed_zero3_enabled

        super().configure_model()
        self.seen = {"configure_model": is_deepspeed_zero3_enabled()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from deepspeed.accelerator import get_accelerator
        from transformers.integrations import is_deepspeed_zero3_enabled

        self.seen.update(training_step=is_deepspeed_zero3_enabled(), accelerator=get_accelerator()._name)
        return super().training_step(batch, batch_idx)


def test_the_zero3_belief_lasts_configure_model_and_deepspeeds_accelerator_the_run(llama_folder: str) -> None:
    # CUDA cannot run here: DeepSpeed's CUDA accelerator object stands in for a GPU machine's auto-detection, which a
    # CPU run replaces for its length
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    cuda = CUDA_Accelerator()
    set_accelerator(cuda)
    module = _RecordsTheBelief(llama_folder, ["x"], together=False, in_configure_model=True)
    before = Snapshot.take()
    trainer = cpu_trainer(strategy=_strategy("nf4"), max_steps=1)
    trainer.fit(module, token_batches(samples=4))
    assert module.seen == {"configure_model": True, "training_step": False, "accelerator": "cpu"}
    _unchanged(before, module, trainer=trainer)
    assert get_accelerator() is cuda


class _DropsLayers(_RecordsTheBelief):
    """A transformers model whose config asks for LayerDrop (wav2vec2's `layerdrop`; Llama's forward ignores it)."""

    def configure_model(self) -> None:
        super().configure_model()
        for sub in self.modules():
            if hasattr(sub, "config"):
                sub.config.layerdrop = 0.1


def test_the_zero3_belief_holds_for_the_steps_of_a_model_that_drops_layers(llama_folder: str) -> None:
    # its forward runs every layer on every rank only where transformers believes ZeRO-3 is on (each layer's gather
    # is a collective); the belief still ends with the run
    module = _DropsLayers(llama_folder, ["x"], together=False, in_configure_model=True)
    before = Snapshot.take()
    trainer = cpu_trainer(strategy=_strategy(), max_steps=1)
    trainer.fit(module, token_batches(samples=4))
    assert module.seen == {"configure_model": True, "training_step": True, "accelerator": "cpu"}
    _unchanged(before, module, trainer=trainer)


def test_two_strategies_in_one_process_keep_their_own_compute_tables() -> None:
    """Each run's layers computed from codes and decode buffers are its compute object's: the second strategy's run
    neither sees nor clears the first's (``zero/frozen_compute.py``)."""
    first, second = _strategy("nf4"), _strategy("nf4")
    held: dict[str, Any] = {}

    class Interleaved(AdapterModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tables = self.trainer.strategy._compute.tables
            held[self.trainer.strategy is first] = (tables, len(tables.layers._layers))
            return super().training_step(batch, batch_idx)

    cpu_trainer(strategy=first, max_steps=1).fit(Interleaved(), regression_data())
    cpu_trainer(strategy=second, max_steps=1).fit(Interleaved(), regression_data())
    (first_tables, first_layers), (second_tables, second_layers) = held[True], held[False]
    assert first_tables is not second_tables and first_tables.buffers is not second_tables.buffers
    assert first_layers == second_layers > 0  # each run computed its own frozen layers from their codes


def _parked_threads() -> int:
    return sum(t.name == waiting_threads.THREAD_NAME for t in threading.enumerate())


def test_a_release_that_raises_still_undoes_the_runs_changes(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Teardown's engine release raising still closes the run's ledger: the module, the libraries, the process's
    OpenMP team, its signal handlers and warning filters are as before, and the release's error reaches the caller."""
    parked: list[int] = []

    class Watched(AdapterModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            parked.append(_parked_threads())
            return super().training_step(batch, batch_idx)

    release = lightning_frozen.strategy.release_engine

    def release_that_raises(engine: Any, model: nn.Module) -> None:
        release(engine, model)  # what it undoes itself undone; then its last step fails
        raise RuntimeError("the release failed")

    monkeypatch.setattr(lightning_frozen.strategy, "release_engine", release_that_raises)
    # OpenMP's team given its parked thread for the whole run (tests/test_waiting_threads.py's way)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(waiting_threads, "CONTENDED_WAIT", -1)
    monkeypatch.setattr(waiting_threads, "MIN_WINDOW_S", 0.0)
    torch_threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(torch_threads))
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    module, threads = Watched(), _parked_threads()
    before = Snapshot.take(module)
    filters, handler = list(warnings.filters), signal.getsignal(signal.SIGTERM)
    trainer = cpu_trainer(strategy=_strategy("nf4"), max_steps=2)
    with pytest.raises(RuntimeError, match="the release failed"):
        trainer.fit(module, regression_data())
    _unchanged(before, module, trainer=trainer)
    assert parked == [threads + 1] * 2 and _parked_threads() == threads  # parked while it ran, gone after
    assert signal.getsignal(signal.SIGTERM) == handler and warnings.filters == filters
    assert torch.nn.functional.linear is before_linear
