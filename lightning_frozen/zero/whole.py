"""``unshard``: a module whose params are ZeRO-3 shards made an ordinary torch module again, with whole tensors.

After a run the module keeps its shards (a next ``fit`` uses them, and the whole base would not fit one rank's memory
for the models the package is for); each still holds DeepSpeed's state, so ``torch.save(module)`` fails on it as after
stock Lightning DeepSpeed. The attributes ZeRO-3 set on the modules are taken off by what its engine's build added.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from torch import nn

from lightning_frozen.capabilities import CORE, require
from lightning_frozen.zero.accelerator import ignore_dependency_deprecations
from lightning_frozen.zero.params import is_partitioned

# what DeepSpeed 0.19's ZeRO-3 hooks set on a module in a forward and backward, after its engine was built
# (`parameter_offload.DeepSpeedZeRoOffload`); a name missing on a module is skipped
SET_IN_FORWARD = ("ds_grads_remaining", "applied_pre_backward_ref_cnt", "pre_bwd_fn", "post_bwd_fn")
# each module's instance attributes that building a DeepSpeed engine over it added (its param offload's bookkeeping),
# held weakly for as long as the module keeps its shards: `unshard` takes them off
_added_by_engine: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


@contextmanager
def engine_additions_recorded(model: nn.Module) -> Iterator[None]:
    """Around building a DeepSpeed engine over ``model``: remember the instance attributes the build adds to each of
    its modules, so that :func:`unshard` takes them off by what the build added rather than by DeepSpeed's names."""
    before = {module: set(vars(module)) for module in model.modules()}
    yield
    for module, names in before.items():
        if added := set(vars(module)) - names:
            _added_by_engine.setdefault(module, set()).update(added)


def unshard(model: nn.Module) -> nn.Module:
    """Make ``model``'s ZeRO-3 params whole ordinary ``nn.Parameter``s, in place, and return ``model``.

    Call it on every rank after the run (``trainer.fit`` returned), while the process group is still up: each param
    is gathered from all ranks. Then ``torch.save(model)``, ``copy.deepcopy(model)`` and calling the model outside a
    Trainer work, with the trained values. Frozen params stored as ``int8``/``nf4`` are decoded to their compute dtype
    (the stored values, not the ones of the original file). Each rank then holds the whole model: do it when that
    fits in memory. A module without ZeRO-3 params is returned unchanged.

    Raises:
        DependencyDriftError: a private name of DeepSpeed's or torch's that it reaches moved.
    """
    import deepspeed

    require(CORE)

    replaced: dict[int, nn.Parameter] = {}
    stop_ignoring = ignore_dependency_deprecations()  # torch's FutureWarning at DeepSpeed's gathers, as in a run
    try:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not is_partitioned(param):
                    continue
                if id(param) not in replaced:
                    with deepspeed.zero.GatheredParameters([param]):
                        whole = param.data.detach().clone()
                    replaced[id(param)] = nn.Parameter(whole, requires_grad=param.requires_grad)
                module._parameters[name] = replaced[id(param)]
    finally:
        stop_ignoring()
    if replaced or _has_zero_attributes(model):
        for module in model.modules():
            _plain_module(module)
    return model


def _has_zero_attributes(model: nn.Module) -> bool:
    modules = list(model.modules())
    return any(module in _added_by_engine for module in modules) or any(
        name in vars(module) for module in modules for name in SET_IN_FORWARD
    )


def _plain_module(module: nn.Module) -> None:
    for name in (*_added_by_engine.pop(module, ()), *SET_IN_FORWARD):
        vars(module).pop(name, None)
    if type(module._parameters) is not dict:  # ZeRO-3's ZeROOrderedDict gathers on read inside a forward
        params: Any = dict(module._parameters)
        module._parameters = params


def still_sharded_notice(
    model: nn.Module, command_line: bool = False, checkpoint: Optional[str] = None
) -> Optional[str]:
    """The line a run that returned logs where ``model``'s params are still ZeRO-3 shards: how to use the module
    outside the Trainer and how to load it for inference or serving; None where no param is a shard. Run from the
    ``lightning-frozen`` command (``command_line``), it names the export steps instead, with the ``checkpoint`` file
    the run wrote where there is one."""
    if not any(is_partitioned(param) for param in model.parameters()):
        return None
    if command_line:
        saved = checkpoint or "CHECKPOINT"
        return (
            f"lightning-frozen: the trained adapter is in the run's checkpoint file. For inference or serving,"
            f" `lightning-frozen export-peft {saved} OUT_DIR` writes a PEFT adapter folder and"
            f" `lightning-frozen export-merged {saved} OUT_DIR` a Hugging Face folder with the adapter merged into its"
            " base (`lightning-frozen STEP --help`)."
        )
    name = type(model).__name__
    return (
        f"lightning-frozen: `{name}`'s params are still ZeRO-3 shards, empty outside the Trainer (torch raises"
        " `'weight' must be 2-D` or `mat2 must be a matrix`). To use it in this script, call"
        " `lightning_frozen.unshard(model)` on every rank; to load it for inference or serving,"
        f" `lightning_frozen.load_from_checkpoint({name}, path)` or `lightning-frozen export-peft` (docs/faq.md)."
    )
