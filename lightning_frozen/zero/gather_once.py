"""A module's ZeRO-3 params gathered whole for one call (``generate``), its layers computed without ZeRO-3's fetches,
as TRL's ``unwrap_model_for_generation`` does; ZeRO-3's hooks stay in place, bypassed for the block on the offload
instance (docs/internals.md says why). Written for DeepSpeed 0.19 (the rows of ``capabilities.GENERATE``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from lightning_frozen.zero.engine import param_offload
from lightning_frozen.zero.frozen_storage import frozen_dtype_of
from lightning_frozen.zero.params import full_numel, is_partitioned

_BYPASSED = ("pre_sub_module_forward_function", "post_sub_module_forward_function")


def whole_bytes(model: nn.Module) -> int:
    """The bytes ``model``'s ZeRO-3 params take gathered whole, in the dtype they compute in (a quantized frozen
    param decodes to its compute dtype); params that are not ZeRO-3 shards are whole already and not counted."""
    params = {id(p): p for p in model.parameters() if is_partitioned(p)}
    return sum(full_numel(p) * p.element_size() for p in params.values())


def available_bytes() -> int:
    """The free memory of the device this rank computes on, as DeepSpeed's accelerator tells it (on the CPU: the
    host's available memory, shared by the ranks on it)."""
    from deepspeed.accelerator import get_accelerator

    return int(get_accelerator().available_memory())


@contextmanager
def gathered_once(model: nn.Module, engine: Any) -> Iterator[None]:
    """Run the block with every ZeRO-3 param of ``model`` (a submodule of ``engine``'s module) gathered whole, once;
    partitioned again after it, also when it raises. Collective: every rank enters it for the same ``model``."""
    import deepspeed

    offload = param_offload(engine)
    # prefetches in flight for these params finish, and the params ZeRO-3 holds whole (persistent ones) are released
    offload.get_param_coordinator().release_and_reset_all(model)
    params = list({id(p): p for p in model.parameters() if is_partitioned(p)}.values())
    quantized = [p for p in params if frozen_dtype_of(p) is not None]
    plain = [p for p in params if frozen_dtype_of(p) is None]
    with ExitStack() as stack:
        # one list each: `GatheredParameters` calls the gather of its first param for all of them
        for group in (quantized, plain):
            if group:
                stack.enter_context(deepspeed.zero.GatheredParameters(group))
        stack.enter_context(_hooks_bypassed(offload, model))
        yield


@contextmanager
def _hooks_bypassed(offload: Any, model: nn.Module) -> Iterator[None]:
    from deepspeed.runtime.zero import parameter_offload

    ours = {id(module) for module in model.modules()}
    fetch, release = (getattr(offload, name) for name in _BYPASSED)

    @torch.no_grad()
    def before_forward(module: nn.Module) -> None:
        if id(module) in ours:
            parameter_offload.FWD_MODULE_STACK.append(module)  # popped by the post-forward hook, as after a fetch
        else:
            fetch(module)

    @torch.no_grad()
    def after_forward(module: nn.Module) -> None:
        if id(module) not in ours:
            release(module)

    offload.pre_sub_module_forward_function = before_forward
    offload.post_sub_module_forward_function = after_forward
    try:
        yield
    finally:
        for name in _BYPASSED:
            vars(offload).pop(name, None)
