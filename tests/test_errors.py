"""Every error the package raises on purpose is a ``FrozenTrainingError``, and still the built-in type callers caught
before (``TypeError``, ``ValueError``, ``FileNotFoundError``, ``NotImplementedError``)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest
from torch import nn

import lightning_frozen
from lightning_frozen import FrozenAwareDeepSpeedStrategy, FrozenTrainingError

PACKAGE = Path(lightning_frozen.__file__).parent

# built-in raises that are not this package's own errors, by file and exception
NOT_OURS = {
    ("memory.py", "AssertionError"),  # an unreachable branch
    ("loops.py", "AttributeError"),  # `__getattr__`'s protocol: the wrapped dataloader has no such attribute
    (
        "optim/unfreezing.py",
        "ValueError",
    ),  # the message torch.optim's own `add_param_group` raises, kept for its callers
}


def _builtin_raises() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                name = node.exc.func.id
                if isinstance(getattr(builtins, name, None), type) and issubclass(getattr(builtins, name), Exception):
                    found.add((path.relative_to(PACKAGE).as_posix(), name))
    return found


def test_no_intentional_error_is_a_bare_built_in() -> None:
    assert _builtin_raises() <= NOT_OURS


def test_errors_are_caught_as_the_package_error_and_as_the_built_in() -> None:
    cases = [
        (lambda: FrozenAwareDeepSpeedStrategy(stage=2), ValueError),
        (lambda: FrozenAwareDeepSpeedStrategy(offload_frozen="yes"), TypeError),
        (lambda: lightning_frozen.read_checkpoint(3), TypeError),
        (lambda: lightning_frozen.read_checkpoint(PACKAGE / "missing.ckpt"), FileNotFoundError),
        (lambda: lightning_frozen.estimate_memory(nn.Linear(2, 2), num_devices=0), ValueError),
        (lambda: lightning_frozen.convert_deepspeed_checkpoint("s3://bucket/run", "out.ckpt"), NotImplementedError),
    ]
    for call, built_in in cases:
        with pytest.raises(FrozenTrainingError) as caught:
            call()
        assert isinstance(caught.value, built_in), (caught.value, built_in)
