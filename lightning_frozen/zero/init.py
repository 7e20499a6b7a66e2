"""``deepspeed.zero.Init``, the context under which modules are built as ZeRO-3 shards (:func:`sharded_creation`),
and importing DeepSpeed.

Code that must build ordinary tensors inside it (PEFT's adapter initialisation, the loader's checksum buffers) steps
outside for a while (:func:`outside_zero_init`). Both keep the ``__init__`` that class decorators gave a class first
imported inside the context (:func:`_keep_decorated_inits`; docs/internals.md says what broke without it).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch


@contextmanager
def sharded_creation(config: dict, remote_device: Optional[str]) -> Iterator[None]:
    """While active, params are ZeRO-3 shards as they are created, on ``remote_device`` (``"cpu"``; None: the
    accelerator), as the DeepSpeed ``config`` says (its dtype, its ZeRO-3 settings)."""
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters

    outermost = partition_parameters.top_level_context is None
    kept = _bookkeeping_present() if outermost else {}
    try:
        with deepspeed.zero.Init(remote_device=remote_device, config_dict_or_path=config):
            try:
                yield
            finally:
                _keep_decorated_inits()
    finally:
        if outermost:
            _forget_bookkeeping(kept)


@contextmanager
def outside_zero_init() -> Iterator[None]:
    """While active, modules and tensors are built as ordinary ones even inside a ``zero.Init``; its patches are put
    back on exit. Does nothing outside a ``zero.Init`` or inside another :func:`outside_zero_init`, so it nests."""
    from deepspeed.runtime.zero import partition_parameters

    context = partition_parameters.top_level_context
    patched = context is not None and context.patched
    if patched:
        _keep_decorated_inits()
        partition_parameters.shutdown_init_context()
    try:
        yield
    finally:
        if patched:
            partition_parameters.restore_init_context()


# what `zero.Init` writes on classes to put their methods back, and leaves there once it did (DeepSpeed 0.19's
# `InsertPostInitMethodToModuleSubClasses.patch_init_and_builtins`); on `torch.nn.Module` it also leaves an
# `__init_subclass__` of its own where the class had none
_BOOKKEEPING = ("_old_init", "_old_apply_of_skip_init_hook")
_MODULE_BOOKKEEPING = ("_old_init_subclass", "_old_apply", "__init_subclass__")
_TENSOR_BOOKKEEPING = ("__old_new__", "__new__")


def _bookkeeping_owners() -> list[tuple[type, tuple[str, ...]]]:
    from deepspeed.runtime.zero import partition_parameters

    owners: list[tuple[type, tuple[str, ...]]] = [(torch.nn.Module, _BOOKKEEPING + _MODULE_BOOKKEEPING)]
    owners += [(cls, _BOOKKEEPING) for cls in partition_parameters.get_all_subclasses(torch.nn.Module)]
    return [*owners, (torch.Tensor, _TENSOR_BOOKKEEPING)]


def _bookkeeping_present() -> dict[type, dict[str, Any]]:
    return {cls: {name: vars(cls)[name] for name in names if name in vars(cls)} for cls, names in _bookkeeping_owners()}


def _forget_bookkeeping(present_before: dict[type, dict[str, Any]]) -> None:
    """Once the outermost ``zero.Init`` put every class's methods back: the attributes it left on classes as they
    were before, deleted where a class did not have them (classes created meanwhile had none); one a stock
    ``zero.Init`` left earlier in the process keeps its earlier value."""
    for cls, names in _bookkeeping_owners():
        before = present_before.get(cls, {})
        for name in names:
            if name in before:
                if vars(cls).get(name) is not before[name]:
                    setattr(cls, name, before[name])
            elif name in vars(cls):
                delattr(cls, name)


def _keep_decorated_inits() -> None:
    """Before DeepSpeed takes its patches off: for each module class whose ``__init__`` a decorator replaced after
    DeepSpeed wrapped it (the class was created inside the context), make that decorated ``__init__`` call the
    class's own again instead of DeepSpeed's wrapper, and have DeepSpeed restore it rather than the undecorated one."""
    from deepspeed.runtime.zero import partition_parameters

    for cls in partition_parameters.get_all_subclasses(torch.nn.Module):
        init, own = cls.__dict__.get("__init__"), cls.__dict__.get("_old_init")
        if init is None or own is None or _is_partition_wrapper(init):
            continue
        for cell in getattr(init, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _is_partition_wrapper(inner) and getattr(inner, "__wrapped__", None) is own:
                cell.cell_contents = own
                cls._old_init = init
                break


def _is_partition_wrapper(function: Any) -> bool:
    """Whether ``function`` is the wrapper ``zero.Init`` puts around a module class's ``__init__``."""
    from deepspeed.runtime.zero import partition_parameters

    code = getattr(function, "__code__", None)
    return code is not None and code.co_name == "wrapper" and code.co_filename == partition_parameters.__file__


def import_deepspeed() -> None:
    """Import DeepSpeed with its log lines on stderr and, where torch sees no accelerator, its CPU accelerator chosen.
    Does nothing once DeepSpeed is imported; a ``DS_ACCELERATOR`` the user set is left as it is. Its log lines stay
    out of a command's output (``--print_config > config.yaml``), and its CPU fallback's warning is not shown.
    """
    if "deepspeed" in sys.modules:
        return
    chosen = "DS_ACCELERATOR" not in os.environ and not torch.accelerator.is_available()
    if chosen:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
    finally:
        if chosen:
            del os.environ["DS_ACCELERATOR"]


def deepspeed_linear_copy() -> type:
    """The class on which ``zero.Init`` keeps its copy of ``F.linear`` for good (an attribute it sets once per
    process), whose attributes the run's ledger puts back as they were without naming it."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    return InsertPostInitMethodToModuleSubClasses


def linear_restorer() -> Callable[[], None]:
    """What puts ``torch.nn.functional.linear`` back as it is now, where a ``zero.Init`` replaced it since (its
    ``memory_efficient_linear`` does, process-wide, for good); a replacement by anyone else is left alone."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    original = torch.nn.functional.linear

    def restore() -> None:
        if torch.nn.functional.linear is zero3_linear_wrap:
            torch.nn.functional.linear = original

    return restore
