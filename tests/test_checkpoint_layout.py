"""The checkpoint layout has one owner (``format/layout.py``): a converted stock DeepSpeed directory holds the
entries a save of the same run writes, and no other package module spells a checkpoint key."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_frozen
from lightning_frozen.format import layout
from tests.models import AdapterModel, StockDeepSpeedOnCPU, cpu_trainer, regression_data
from tests.peft_models import PeftModule, batches, save_tiny_llama

# how the file was written: a save records its precision, `convert` where it converted from
_MARKER_DETAILS = {layout.PRECISION, layout.CONVERTED_FROM}


def _adam(module: AdapterModel) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=0.02)


def _skeleton(value: Any) -> Any:
    """Keys all the way down, with each leaf's type name: what two checkpoints of one layout share."""
    if isinstance(value, dict):
        return {key: _skeleton(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_skeleton(item) for item in value]]
    if torch.is_tensor(value):
        return f"Tensor[{value.dtype}]"
    return type(value).__name__


def _saved_and_converted(tmp: Path, build: Callable[[], Any], data: Callable[[], Any]) -> tuple[Path, Path]:
    """The same run saved by the strategy, and saved by stock ``DeepSpeedStrategy`` then converted."""
    saved, stock = tmp / "saved.ckpt", tmp / "stock.ckpt"
    trainer = cpu_trainer(max_steps=2)
    trainer.fit(build(), data())
    trainer.save_checkpoint(saved)
    trainer = cpu_trainer(StockDeepSpeedOnCPU(stage=3), max_steps=2)
    trainer.fit(build(), data())
    trainer.save_checkpoint(stock)
    converted = lightning_frozen.convert_deepspeed_checkpoint(stock, tmp / "converted.ckpt", module=build())
    return saved, converted


@pytest.fixture(scope="module")
def adapter_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _saved_and_converted(
        tmp_path_factory.mktemp("adapter"), lambda: AdapterModel(optimizer_fn=_adam), regression_data
    )


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("peft")
    llama = str(save_tiny_llama(tmp / "llama"))
    return _saved_and_converted(tmp, lambda: PeftModule("prefix_tuning", llama), lambda: batches("prefix_tuning"))


def _groups_of_trained_names(saved: dict[str, Any]) -> dict[str, Any]:
    """A save's groups list the frozen params the user's optimizer holds too; a DeepSpeed directory records only the
    params each group trains (``param_shapes``), which a converted file lists: ``saved`` with its groups so."""
    for group in saved[layout.OPTIMIZER_STATES][0]["param_groups"]:
        group["params"] = [name for name in group["params"] if name in saved["state_dict"]]
    return saved


@pytest.mark.parametrize("run", ["adapter_model", "peft_model"])
def test_convert_writes_what_a_save_writes(run: str, request: pytest.FixtureRequest) -> None:
    saved_path, converted_path = request.getfixturevalue(run)
    saved = torch.load(saved_path, weights_only=True)
    converted = torch.load(converted_path, weights_only=True)
    saved_marker, converted_marker = saved.pop(layout.FORMAT_KEY), converted.pop(layout.FORMAT_KEY)
    assert _skeleton(converted) == _skeleton(_groups_of_trained_names(saved))
    assert set(saved_marker) ^ set(converted_marker) == _MARKER_DETAILS
    assert converted_marker[layout.WORLD_SIZE] == saved_marker[layout.WORLD_SIZE] == 1
    assert converted[layout.FROZEN_BASE][layout.FINGERPRINT] == saved[layout.FROZEN_BASE][layout.FINGERPRINT]
    assert converted[layout.OPTIMIZER_STATES][0][layout.LOSS_SCALER] == {"cur_scale": 1.0}
    assert converted[layout.FROZEN_BASE][layout.REFERENCE] == saved[layout.FROZEN_BASE][layout.REFERENCE]


def test_a_converted_peft_run_exports_as_a_saved_one(peft_model: tuple[Path, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    saved, converted = peft_model
    ours = lightning_frozen.export_peft_adapter(saved, tmp_path / "saved")
    theirs = lightning_frozen.export_peft_adapter(converted, tmp_path / "converted")
    assert (ours / "adapter_config.json").read_text() == (theirs / "adapter_config.json").read_text()
    assert sorted(load_file(ours / "adapter_model.safetensors")) == sorted(
        load_file(theirs / "adapter_model.safetensors")
    )


def test_convert_without_the_module_leaves_out_only_what_the_directory_lacks(
    adapter_model: tuple[Path, Path], tmp_path: Path
) -> None:
    saved = torch.load(adapter_model[0], weights_only=True)
    stock = adapter_model[1].parent / "stock.ckpt"
    bare = torch.load(lightning_frozen.convert_deepspeed_checkpoint(stock, tmp_path / "bare.ckpt"), weights_only=True)
    assert bare[layout.FROZEN_BASE][layout.REFERENCE] is None  # the module's `frozen_base_reference` is not on disk
    bare[layout.FROZEN_BASE][layout.REFERENCE] = saved[layout.FROZEN_BASE][layout.REFERENCE]
    for checkpoint in (saved, bare):
        checkpoint.pop(layout.FORMAT_KEY)
    assert _skeleton(bare) == _skeleton(_groups_of_trained_names(saved))


# ---------------------------------------------------------------------------------------------- one owner

_PACKAGE = Path(lightning_frozen.__file__).parent
_LAYOUT = _PACKAGE / "format" / "layout.py"
# keys torch's and DeepSpeed's optimizer states, safetensors' headers (the merged export) and the Trainer's
# options (the CLI's estimate reads a config's `precision`) spell too
_SHARED_WITH_TORCH_AND_DEEPSPEED = {"params", "state", "param_groups", "config", "dtype", "shape", "precision"}


def _layout_keys() -> set[str]:
    """The string values of layout.py's module-level constants."""
    keys = set()
    for node in ast.parse(_LAYOUT.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            keys.add(node.value.value)
    return keys


def _spelled_keys(tree: ast.AST) -> list[tuple[int, str]]:
    """String literals used as a subscript, a ``get``/``pop``/``setdefault`` key or a dict display's key."""
    found = []
    for node in ast.walk(tree):
        candidates: list[ast.expr] = []
        if isinstance(node, ast.Subscript):
            candidates = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "pop", "setdefault"):
                candidates = [node.args[0]]
        elif isinstance(node, ast.Dict):
            candidates = [key for key in node.keys if key is not None]
        found += [(c.lineno, c.value) for c in candidates if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return found


def test_no_module_but_layout_spells_a_checkpoint_key() -> None:
    keys = _layout_keys() - _SHARED_WITH_TORCH_AND_DEEPSPEED
    assert {layout.STATE_DICT, layout.FROZEN_BASE, layout.VALUE, layout.ADAPTER_NAME} <= keys
    problems = [
        f"{path.relative_to(_PACKAGE)}:{line} spells `{key}`"
        for path in sorted(_PACKAGE.rglob("*.py"))
        if path != _LAYOUT
        for line, key in _spelled_keys(ast.parse(path.read_text()))
        if key in keys
    ]
    assert not problems, "use format/layout.py's constants or accessors: " + "; ".join(problems)


def test_the_scan_finds_a_spelled_key() -> None:
    tree = ast.parse('frozen = checkpoint["frozen_base"].get("fingerprint")\nentry = {"adapter_name": name}')
    assert sorted(_spelled_keys(tree)) == [(1, "fingerprint"), (1, "frozen_base"), (2, "adapter_name")]
