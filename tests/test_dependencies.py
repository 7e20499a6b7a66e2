"""Loud on drift (issues 36, 44): every private name of Lightning, DeepSpeed, transformers, PEFT and torch the package
relies on is a row of ``capabilities.py``'s one table, under the core or the capability that needs it, checked when a
strategy is built. A moved name of the core raises there, naming the package, its version, the name and the releases
the package was written for; one of an optional capability turns it off with one warning; a teardown that reaches a
moved DeepSpeed name warns and lets the run's own error through. pyproject's lower bounds are the releases the tests
run on. tests/test_capabilities.py deletes names as a release would, in a fresh process.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.strategies import DeepSpeedStrategy

import lightning_frozen
from lightning_frozen import DependencyDriftError, FrozenAwareDeepSpeedStrategy, capabilities, foreign_names
from lightning_frozen.foreign_names import ForeignName, problem_of
from tests.models import AdapterModel, cpu_trainer, regression_data
from tests.test_hf_seams import HF_INTERNALS, package_private_names
from tests.test_seams import DEEPSPEED_INTERNALS, SEAM

ROOT = Path(lightning_frozen.__file__).parent.parent
ROWS = capabilities.ROWS
# bitsandbytes' param classes, read by their names only where bitsandbytes quantized a model (not one of the five)
READ_BY_CLASS_NAME = {"Params4bit", "Int8Params"}


@pytest.fixture
def fresh_lookup() -> Iterator[None]:
    """The once-per-process lookup (and its warnings) done again in this test, and again after it: the names it moves
    come back."""
    capabilities.moved_names.cache_clear()
    capabilities._warn_off.cache_clear()
    yield
    capabilities.moved_names.cache_clear()
    capabilities._warn_off.cache_clear()


def _covered() -> set[str]:
    """Every name a row stands for: each part of its target, and the attributes it looks for in code."""
    return {part for row in ROWS for part in (*re.split(r"[.:]", row.target), *row.in_code)}


def _ds_attributes() -> set[str]:
    """The ``ds_*`` attributes of ZeRO-3 params that the DeepSpeed seam reads or writes."""
    trees = [ast.parse(path.read_text()) for path in SEAM.rglob("*.py")]
    attributes = (node.attr for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Attribute))
    return {name for name in attributes if name.startswith("ds_")}


def test_every_private_name_the_package_uses_has_a_row() -> None:
    used = set(package_private_names()) | DEEPSPEED_INTERNALS | (HF_INTERNALS - READ_BY_CLASS_NAME) | _ds_attributes()
    assert {"_init_optimizers", "_PartitionedParameterCoordinator__params_to_release", "ds_tensor"} <= used
    assert sorted(used - _covered()) == []  # add a row to the seam's table (docs/internals.md lists them)


# Python's own dunder names, which a row may name (`__init__`, `__init_subclass__`, `__getitem__`): no package's private
PYTHON_DUNDERS = {name for cls in (type, dict, int) for name in dir(cls) if name.startswith("__")}


def reached_private_names() -> set[str]:
    """Every private name of another package the package reads: in its code (``package_private_names``) and through
    the rows' strings (each underscored part of a target, and each of ``in_code``); Python's own dunder names left
    out, DeepSpeed's ``__old_new__`` counted."""
    rows = {part for row in ROWS for part in (*re.split(r"[.:]", row.target), *row.in_code)}
    names = set(package_private_names()) | rows
    return {name for name in names if name.startswith("_") and name not in PYTHON_DUNDERS}


def test_the_package_reads_at_most_40_private_names_of_other_packages() -> None:
    # issue 63: 42 before; fewer by a public API where there is one, or by a capability that does not pay
    names = reached_private_names()
    assert {"_init_optimizers", "_version", "__old_new__", "_gradient_checkpointing_func"} <= names  # code and rows
    assert len(names) <= 40, sorted(names)


def test_every_row_holds_in_the_installed_packages() -> None:
    assert {row.dotted: problem for row in ROWS if (problem := problem_of(row))} == {}
    assert {row.package for row in ROWS} == set(foreign_names.WRITTEN_FOR)
    assert [capability.name for capability in capabilities.OPTIONAL if not capabilities.available(capability)] == []
    assert capabilities.moved_names(capabilities.CORE) == ()


def test_the_check_finds_a_name_gone_a_signature_changed_and_an_attribute_no_longer_set() -> None:
    rows = [
        ForeignName("lightning.pytorch.strategies:DeepSpeedStrategy._no_such_hook", "x.py"),
        ForeignName("lightning_frozen.no_such_module:name", "x.py"),
        ForeignName(
            "lightning.pytorch.strategies:DeepSpeedStrategy._init_optimizers", "x.py", ("self", "x"), exact=True
        ),
        ForeignName("lightning.pytorch.callbacks:BaseFinetuning._store", "x.py", ("self", "pl_module", "num")),
        ForeignName("lightning.pytorch:LightningModule.__init__", "x.py", in_code=("_trainer", "_no_such_attribute")),
    ]
    assert [problem_of(row) for row in rows] == [
        "is gone",
        "is gone",
        "takes (self), not (self, x)",
        "takes (self, pl_module, opt_idx, num_param_groups, current_param_groups), not (self, pl_module, num)",
        "no longer sets or reads `_no_such_attribute`",
    ]
    # a call passing the leading parameters still fits a function that gained one with a default; an override does not
    assert problem_of(ForeignName("lightning.pytorch:Trainer._run", "x.py", ("self", "model"))) is None
    assert problem_of(ForeignName("lightning.pytorch:Trainer._run", "x.py", ("self", "model"), exact=True))


def test_deepspeeds_uninstrumented_wrappers_are_checked_by_the_function_they_wrap() -> None:
    target = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads"
    assert problem_of(ForeignName(target, "x.py", ("self", "sub_group_id", "total_norm"), exact=True)) is None
    assert problem_of(ForeignName(target, "x.py", ("self", "sub_group_id"), exact=True))


def test_the_strategy_builds_after_torch_compile_wrapped_module_init() -> None:
    # torch.compile's first compile wraps nn.Module.__init__ in a `(self, *args, **kwargs)` closure, for good: the
    # check then read the wrapper's code and raised DependencyDriftError. In a process of its own, as a user's is.
    script = (
        "import torch\n"
        "torch.compile(lambda x: x + 1, backend='eager')(torch.ones(3))\n"
        "assert torch.nn.Module.__init__.__name__ == 'patched_init'\n"
        "from lightning_frozen import FrozenAwareDeepSpeedStrategy\n"
        "FrozenAwareDeepSpeedStrategy()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_removed_lightning_hook_fails_at_construction(monkeypatch: pytest.MonkeyPatch, fresh_lookup: None) -> None:
    monkeypatch.delattr(DeepSpeedStrategy, "_init_optimizers")  # a release that renamed it
    with pytest.raises(DependencyDriftError) as raised:
        FrozenAwareDeepSpeedStrategy()
    message = str(raised.value)
    assert (
        "lightning 2.6.6: `lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy._init_optimizers` is gone"
        in message
    )
    assert "(used in lightning_seam.py)" in message
    assert "written for torch 2.13, lightning 2.6.6, deepspeed 0.19.8, peft 0.21.2, transformers 5.25" in message
    with pytest.raises(DependencyDriftError):  # every construction, not only the first
        FrozenAwareDeepSpeedStrategy()


def test_a_moved_deepspeed_name_fails_at_construction(monkeypatch: pytest.MonkeyPatch, fresh_lookup: None) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, "_optimizer_step")
    with pytest.raises(DependencyDriftError, match=r"deepspeed 0\.19\.8: `.*Stage3\._optimizer_step` is gone"):
        FrozenAwareDeepSpeedStrategy()


def test_a_changed_signature_fails_at_construction(monkeypatch: pytest.MonkeyPatch, fresh_lookup: None) -> None:
    def setup(self: Any, model: Any, optimizer: Any, lr_scheduler: Any = None, model_parameters: Any = None) -> Any:
        return None  # a release that passes one argument more to the hook the strategy overrides

    def store(self: Any, pl_module: Any, num_param_groups: int, current_param_groups: list) -> None:
        return None  # a release whose `_store` the finetuning callbacks would call with the wrong arguments

    monkeypatch.setattr(DeepSpeedStrategy, "_setup_model_and_optimizer", setup)
    monkeypatch.setattr(BaseFinetuning, "_store", store)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(DependencyDriftError) as raised:
        warnings.simplefilter("always")
        FrozenAwareDeepSpeedStrategy()
    assert [str(w.message) for w in caught if "unfreezing" in str(w.message)] == []  # looked up where first used
    message = str(raised.value)
    assert "1 of them" in message  # `_store` is progressive unfreezing's, which this run does not ask for
    assert (
        "`lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy._setup_model_and_optimizer` takes (self, model,"
        " optimizer, lr_scheduler, model_parameters), not (self, model, optimizer, lr_scheduler)" in message
    )
    with pytest.raises(DependencyDriftError, match=r"`.*BaseFinetuning\._store` takes \(self, pl_module,"):
        capabilities.require(capabilities.UNFREEZING)  # where a finetuning callback first unfreezes


def test_a_capability_the_run_did_not_ask_for_warns_once(monkeypatch: pytest.MonkeyPatch, fresh_lookup: None) -> None:
    from transformers import modeling_utils

    monkeypatch.delattr(modeling_utils, "safe_open")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FrozenAwareDeepSpeedStrategy()
        FrozenAwareDeepSpeedStrategy()
        assert caught == []  # not looked up when a strategy is built: only where the capability is first used
        assert not capabilities.available(capabilities.SLICED_LOADING)
        assert not capabilities.available(capabilities.SLICED_LOADING)
    moved = [str(w.message) for w in caught if "safe_open" in str(w.message)]
    assert len(moved) == 1
    assert moved[0].startswith("lightning-frozen: sliced loading from hub folders is off, because transformers 5.25")
    assert "each rank reads every tensor whole" in moved[0] and "written for" in moved[0]
    assert not capabilities.available(capabilities.SLICED_LOADING) and capabilities.available(capabilities.CORE)


class _RaisesAfterDeepSpeedMoved(AdapterModel):
    """Its first step finds DeepSpeed's ``FWD_MODULE_STACK`` gone (as a release that renamed it would leave the
    teardown), then raises."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.monkeypatch = monkeypatch

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        from deepspeed.runtime.zero import parameter_offload

        self.monkeypatch.delattr(parameter_offload, "FWD_MODULE_STACK")
        raise ValueError("the run's own error")


def test_a_teardown_that_reaches_a_moved_name_warns_and_lets_the_runs_error_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert capabilities.available(capabilities.RELEASE)  # looked up before the name moves, as by an earlier run
    trainer = cpu_trainer(max_steps=2)
    with (
        pytest.raises(ValueError, match="the run's own error"),
        pytest.warns(
            UserWarning, match=r"a name of releasing a finished run's engine moved \(AttributeError: .*FWD_MOD"
        ),
    ):
        trainer.fit(_RaisesAfterDeepSpeedMoved(monkeypatch), regression_data())


def test_pyprojects_lower_bounds_are_the_releases_the_package_was_written_for() -> None:
    requirements = re.findall(r'"([\w-]+)(?:\[[\w,]+\])?>=([\w.]+)', (ROOT / "pyproject.toml").read_text())
    bounds = {package: version for package, version in requirements if package in foreign_names.WRITTEN_FOR}
    assert bounds == foreign_names.WRITTEN_FOR  # each a release the tests ran, in the dependencies or the test extra
