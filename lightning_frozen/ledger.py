"""``RunLedger``: everything one run changes outside the package's own objects, each change with its undo.

The strategy opens one ledger when a run sets up and closes it at teardown, whether the run returned, raised or
stopped for preemption, so the user's modules, other packages' classes and the process are left as they were. Undos
run newest first; one that fails becomes a warning and the others still run, so it never hides the run's own error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any, TypeVar

import lightning.pytorch as pl

from lightning_frozen.preemption import Preemption
from lightning_frozen.zero import accelerator
from lightning_frozen.zero.frozen_compute import FrozenCompute
from lightning_frozen.zero.init import deepspeed_linear_copy, linear_restorer

T = TypeVar("T")
_ABSENT = object()


class RunLedger:
    """The changes of one run, undone by :meth:`close` (then the ledger is empty and may be used again)."""

    def __init__(self) -> None:
        self._undos: list[tuple[str, Callable[[], Any]]] = []

    def callback(self, undo: Callable[[], Any], what: str = "") -> None:
        """Call ``undo()`` when the run ends; ``what`` names the change in a warning should the undo fail."""
        self._undos.append((what or getattr(undo, "__qualname__", repr(undo)), undo))

    def enter(self, context: AbstractContextManager[T], what: str = "") -> T:
        """Enter ``context`` now and leave it when the run ends."""
        value = context.__enter__()
        self.callback(lambda: context.__exit__(None, None, None), what or type(context).__qualname__)
        return value

    def set_attribute(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value`` for the run; at its end the attribute is as it was (deleted if it was absent)."""
        self.keep_attribute(owner, name)
        setattr(owner, name, value)

    def keep_attribute(self, owner: Any, name: str) -> None:
        """At the run's end, put ``owner``'s own ``name`` back as it is now, whoever changes it meanwhile (a
        dependency that sets an attribute for good, such as Lightning's forward redirection)."""
        before = vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else getattr(owner, name, _ABSENT)

        def restore() -> None:
            if before is _ABSENT:
                if name in vars(owner):
                    delattr(owner, name)
            elif vars(owner).get(name, _ABSENT) is not before:
                setattr(owner, name, before)

        self.callback(restore, f"{getattr(owner, '__qualname__', type(owner).__qualname__)}.{name}")

    def keep_class_attributes(self, owner: type) -> None:
        """At the run's end, ``owner``'s own attributes as they are now: one added meanwhile deleted, one rebound put
        back (a dependency that keeps what it set on a class for good, under whatever name: ``zero.Init``'s copy of
        ``F.linear``)."""
        before = dict(vars(owner))

        def restore() -> None:
            for name in [name for name in vars(owner) if name not in before]:
                delattr(owner, name)
            for name, value in before.items():
                if vars(owner).get(name, _ABSENT) is not value:
                    setattr(owner, name, value)

        self.callback(restore, f"{owner.__qualname__}'s attributes")

    def scope(self, what: str) -> ExitStack:
        """A stack of changes that may be undone and refilled during the run (``.close()``), and is undone at its end
        (the hooks of the layers an engine guards: an engine rebuilt mid-run replaces them)."""
        stack = ExitStack()
        self.callback(stack.close, what)
        return stack

    def close(self) -> None:
        """Undo every change, newest first. An undo that raises becomes a warning; the rest still run."""
        undos, self._undos = self._undos, []
        for what, undo in reversed(undos):
            try:
                undo()
            except Exception as error:  # noqa: BLE001 - teardown must not hide the run's own error
                warnings.warn(
                    f"lightning-frozen: undoing `{what}` at the end of the run failed"
                    f" ({type(error).__name__}: {error}); the process may keep that change.",
                    RuntimeWarning,
                    stacklevel=2,
                )


def open_run(ledger: RunLedger, module: pl.LightningModule, preemption: Preemption, compute: FrozenCompute) -> None:
    """Enter in ``ledger`` what every run of the strategy changes, before it changes it (``compute``: how this run's
    frozen shards compute, whose changes its ``end_run`` undoes)."""
    ledger.callback(accelerator.ignore_dependency_deprecations(), "the filter of dependencies' deprecation warnings")
    ledger.callback(linear_restorer(), "torch.nn.functional.linear")  # `zero.Init` replaces it for good
    ledger.keep_class_attributes(deepspeed_linear_copy())
    ledger.keep_attribute(module, "forward")  # Lightning's forward redirection leaves a bound method on the instance
    ledger.callback(compute.end_run, "the frozen compute's layers and buffers")
    trainer = module.trainer
    ledger.callback(lambda: preemption.uninstall(trainer), "the preemption callback")
