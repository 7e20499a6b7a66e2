"""ZeRO-3 prefetches when ``training_step`` calls ``self(x)`` (zero/forward_trace.py, issue 24).

Lightning runs the step inside the engine's call of the LightningModule, so ``self(x)`` calls the module a second
time; DeepSpeed's start-of-forward hook then resets its trace mid-step and nothing is ever prefetched. The strategy
runs that hook at the outermost call only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.zero import engine, forward_trace
from lightning_frozen.zero.params import full_param
from tests.distributed import read_reports, run_script
from tests.models import AdapterModel, cpu_trainer, regression_data
from tests.peft_models import PeftModule, batches


class Reentrant(nn.Module):
    """Calls itself once inside its own call, as a step that calls ``self(x)`` does under Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inner:
            self.inner = True
            try:
                return self(x)
            finally:
                self.inner = False
        if x.sum() < 0:
            raise ValueError("a forward that raises")
        return x


class Offload:
    """What DeepSpeed's ``DeepSpeedZeRoOffload`` holds of its module hooks: the start-of-forward hook's handle."""

    def __init__(self, module: nn.Module) -> None:
        self.resets = 0
        self.fwd_pre_hook = module.register_forward_pre_hook(self.start_of_forward)
        self.forward_hooks: list[Any] = []

    def start_of_forward(self, module: nn.Module, args: tuple) -> None:
        self.resets += 1


def test_the_start_of_forward_hook_runs_once_per_outermost_call_until_restored() -> None:
    module = Reentrant()
    offload = Offload(module)
    assert forward_trace.reset_trace_at_outermost_call(module, offload)
    module(torch.ones(2))
    module(torch.ones(2))
    assert offload.resets == 2
    with pytest.raises(ValueError, match="raises"):
        module(-torch.ones(2))
    module(torch.ones(2))
    assert offload.resets == 4  # the call that raised left the module outside its call again
    forward_trace.restore_trace_reset(module)
    module(torch.ones(2))
    assert offload.resets == 6  # DeepSpeed's own hook again: the inner call resets too
    assert offload.forward_hooks == []


def test_a_hook_not_found_on_the_module_is_left_alone_and_said_so() -> None:
    module = Reentrant()
    offload = Offload(module)
    offload.fwd_pre_hook = None  # a DeepSpeed that keeps its handle elsewhere
    with pytest.warns(UserWarning, match="DeepSpeed's start-of-forward hook is not on the module"):
        assert not forward_trace.reset_trace_at_outermost_call(module, offload)
    module(torch.ones(2))
    assert offload.resets == 2


def test_a_fit_leaves_deepspeeds_own_hook_on_the_module() -> None:
    model = AdapterModel()
    installed = []

    class Check(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            installed.append(_replaced_hooks(pl_module))

    cpu_trainer(FrozenAwareDeepSpeedStrategy(), callbacks=[Check()], max_steps=2).fit(model, regression_data())
    assert installed == [1, 1]
    assert _replaced_hooks(model) == 0  # undone at teardown


def _replaced_hooks(module: nn.Module) -> int:
    hooks = module._forward_pre_hooks.values()
    return sum(getattr(getattr(hook, "__self__", None), "__module__", "") == forward_trace.__name__ for hook in hooks)


@pytest.fixture(scope="module")
def self_call_fits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 2-rank fits of a step that calls ``self(x)``: as shipped, and with DeepSpeed's hook left alone."""
    tmp = tmp_path_factory.mktemp("prefetch_self_call")
    run_script("prefetch_self_call.py", f"--out={tmp}")
    return tmp


def _in_flight_by_step(report: dict[str, Any]) -> dict[int, int]:
    """Per step, the gathers that frozen layers' forwards ran past before their work was waited on."""
    counts: dict[int, int] = {}
    for gather in report["gathers"]:
        if gather["step"] >= 0:
            ahead = gather["waited_at"] is not None and gather["waited_at"] > gather["started_at"]
            counts[gather["step"]] = counts.get(gather["step"], 0) + ahead
    return counts


@pytest.mark.slow
def test_a_step_that_calls_self_prefetches_after_the_first_step(self_call_fits: Path) -> None:
    shipped, stock = read_reports(self_call_fits / "shipped"), read_reports(self_call_fits / "stock")
    assert len(shipped) == len(stock) == 2
    for report in shipped:
        assert report["global_step"] == 4
        in_flight = _in_flight_by_step(report)
        assert sorted(in_flight) == [0, 1, 2, 3]
        assert all(in_flight[step] > 0 for step in (1, 2, 3)), in_flight  # step 0 records the trace
    for report in stock:
        assert set(_in_flight_by_step(report).values()) == {0}  # DeepSpeed's own hook: nothing is ever prefetched


@pytest.mark.slow
def test_prefetching_trains_exactly_as_fetching_on_demand(self_call_fits: Path) -> None:
    shipped, stock = read_reports(self_call_fits / "shipped"), read_reports(self_call_fits / "stock")
    assert len(shipped) == len(stock) == 2
    for prefetched, fetched in zip(shipped, stock):
        assert prefetched["trainable"] == fetched["trainable"]


class _HooksSeen(Callback):
    """At the first and the last step: which of the module's submodules carry ZeRO-3's hooks, and which the light
    ones of a module whose hooks were taken off (``engine.TrimmedHooks``), by name."""

    def __init__(self) -> None:
        self.hooked: dict[str, bool] = {}
        self.light: dict[str, bool] = {}
        self.last_hooked: dict[str, bool] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        offload = engine.param_offload(trainer.strategy.model)
        handles = [(handle, handle.hooks_dict_ref()) for handle in (*offload.forward_hooks, *offload.backward_hooks)]
        live = [(hooks, hooks[handle.id]) for handle, hooks in handles if hooks is not None and handle.id in hooks]
        light = {id(hooks) for hooks, hook in live if isinstance(getattr(hook, "__self__", None), engine.TrimmedHooks)}
        deepspeeds = {id(hooks) for hooks, _ in live} - light
        hooked = {name: id(module._forward_pre_hooks) in deepspeeds for name, module in pl_module.named_modules()}
        self.last_hooked = hooked
        if not batch_idx:
            self.hooked = hooked
            self.light = {name: id(module._forward_pre_hooks) in light for name, module in pl_module.named_modules()}


def _fit_seen(monkeypatch: pytest.MonkeyPatch, trim: bool) -> tuple[PeftModule, _HooksSeen]:
    if not trim:
        monkeypatch.setattr(engine, "hook_only_param_holders", lambda engine, model: 0)
    seen = _HooksSeen()
    module = PeftModule("lora_modules_to_save")
    cpu_trainer(max_steps=3, callbacks=[seen]).fit(module, batches("lora_modules_to_save"))
    monkeypatch.undo()
    return module, seen


def test_zero3_hooks_run_only_around_modules_that_hold_params_and_train_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module, seen = _fit_seen(monkeypatch, trim=True)
    holders = {name for name, m in module.named_modules() if next(m.parameters(recurse=False), None) is not None}
    idle = set(seen.hooked) - holders - {""}
    assert holders and len(idle) > len(holders)  # a PEFT model: dicts, dropouts, wrappers, attention around layers
    assert {name for name in holders if not seen.hooked[name]} == set()
    assert {name for name in idle if seen.hooked[name]} == set()
    assert seen.hooked[""]  # the engine's module keeps its own, which start and end DeepSpeed's forward
    # a light pair where a module without params has some under it (it could read a child's weight), none elsewhere
    under = {name for name in idle if next(module.get_submodule(name).parameters(), None) is not None}
    assert under and {name for name, light in seen.light.items() if light} == under
    assert seen.last_hooked == seen.hooked  # no module read a child's weight: none got DeepSpeed's hooks back
    reference, everywhere = _fit_seen(monkeypatch, trim=False)
    assert all(everywhere.hooked.values())
    trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    for (name, param), expected in zip(trained, (p for p in reference.parameters() if p.requires_grad)):
        torch.testing.assert_close(full_param(param), full_param(expected), rtol=1e-5, atol=1e-6, msg=name)
    initial = dict(PeftModule("lora_modules_to_save").named_parameters())
    assert any(not torch.equal(full_param(param), initial[name]) for name, param in trained)  # it trained
