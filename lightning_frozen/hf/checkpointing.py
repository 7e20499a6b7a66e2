"""What the package uses of transformers' gradient checkpointing: each module that checkpoints its forward holds the
function it checkpoints with, ``_gradient_checkpointing_func`` (set by ``gradient_checkpointing_enable`` on every
module with a ``gradient_checkpointing`` flag, in transformers 4.35 to 5.x), and calls it with the forward to run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from torch import nn

FUNC = "_gradient_checkpointing_func"


def checkpointing_modules(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules of ``model`` with gradient checkpointing on: those that checkpoint through ``FUNC``, and those
    that do it some other way (whose recomputed forward cannot be reached)."""
    reachable: list[nn.Module] = []
    unreachable: list[nn.Module] = []
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            (reachable if callable(getattr(module, FUNC, None)) else unreachable).append(module)
    return reachable, unreachable


@contextmanager
def recomputed_within(module: nn.Module, context: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """While open, each forward ``module`` checkpoints runs inside ``context()``: when it runs and again when
    backward recomputes it, which may be after this context has closed."""
    checkpoint = getattr(module, FUNC)
    had_own = FUNC in module.__dict__

    def within(function: Any, *args: Any, **kwargs: Any) -> Any:
        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            with context():
                return function(*inner, **inner_kwargs)

        return checkpoint(run, *args, **kwargs)

    setattr(module, FUNC, within)
    try:
        yield
    finally:
        if had_own:
            setattr(module, FUNC, checkpoint)
        else:
            delattr(module, FUNC)
