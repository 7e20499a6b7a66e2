"""The trainable state of a ZeRO-3 run by parameter name: what a checkpoint holds, and putting it back.

Whole tensors keyed by name, so a checkpoint written by any number of ranks resumes on any other: a save's dict holds
placeholders for them, gathered to the writing rank one at a time as the file is written (``streamed_save.py``); a
resume copies each rank's own part of each out of the file (``zero/params.py``'s ``set_full_param``). The
``frozen_base`` entry records what the trainable state was trained on. Every function that scatters is collective
under ZeRO-3: every rank calls it in the same order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_frozen.anatomy import Anatomy
from lightning_frozen.checkpoint.adapter_entries import peft_entries
from lightning_frozen.checkpoint.loading import check_keys
from lightning_frozen.checkpoint.streamed_save import DeferredTensors
from lightning_frozen.errors import CheckpointFormatError
from lightning_frozen.format import layout
from lightning_frozen.format.codec import block_format
from lightning_frozen.zero.frozen_storage import frozen_dtype_of
from lightning_frozen.zero.params import (
    ensure_optimizer_state,
    loss_scaler_state,
    persistent_buffers,
    restore_loss_scaler,
    set_full_param,
    set_optimizer_state,
)


def optimizer_holding(name: str, deepspeed_optimizer: Any, ungrouped_names: Collection[str]) -> Any:
    """The ZeRO optimizer if it holds the param (and its fp32 master copy), else None."""
    return None if name in ungrouped_names else deepspeed_optimizer


def trainable_state_dict(
    module: nn.Module, deepspeed_optimizer: Any, deferred: DeferredTensors, ungrouped_names: Collection[str] = ()
) -> dict[str, Any]:
    """The trainable params and persistent buffers; never a frozen weight. Each trainable param is a placeholder of
    its whole fp32 value, which ``deferred`` gathers as the file is written (``streamed_save.py``)."""
    state = {
        name: deferred.placeholder(param, optimizer_holding(name, deepspeed_optimizer, ungrouped_names))
        for name, param in module.named_parameters()
        if param.requires_grad
    }
    state.update({name: buffer.detach().cpu().clone() for name, buffer in persistent_buffers(module).items()})
    return state


def load_trainable_state(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    deepspeed_optimizer: Any,
    ungrouped_names: Collection[str] = (),
    strict: bool = True,
) -> None:
    """Write a :func:`trainable_state_dict` into the module's trainable params (and fp32 master copies) and buffers.

    Raises:
        CheckpointKeysError: with ``strict``, trainable params the state lacks or keys the module lacks.
    """
    params = dict(module.named_parameters())
    buffers = persistent_buffers(module)
    trainable = {name: param for name, param in params.items() if param.requires_grad}
    if strict:
        check_keys(state_dict, trainable, buffers, "the checkpoint")
    for name, value in state_dict.items():
        if name in trainable:
            holder = optimizer_holding(name, deepspeed_optimizer, ungrouped_names)
            set_full_param(trainable[name], value, holder)
        elif name in buffers:
            buffers[name].data.copy_(value.to(device=buffers[name].device, dtype=buffers[name].dtype))


def optimizer_state_by_name(
    deepspeed_optimizer: Any, module: nn.Module, group_param_names: list[list[str]], deferred: DeferredTensors
) -> dict[str, Any]:
    """The optimizer state keyed by param name, whole tensors (any world size can resume it): each per-element state
    a placeholder that ``deferred`` gathers as the file is written. The groups list their frozen params too, as the
    user's optimizer holds them; those have no state."""
    params = dict(module.named_parameters())
    groups = [
        layout.param_group_entry(group, names)
        for group, names in zip(deepspeed_optimizer.param_groups, group_param_names)
    ]
    state = {
        name: deferred.optimizer_state(deepspeed_optimizer, params[name])
        for names in group_param_names
        for name in names
        if params[name].requires_grad
    }
    return layout.optimizer_entry(state, groups, loss_scaler_state(deepspeed_optimizer))


def load_optimizer_state_by_name(deepspeed_optimizer: Any, module: nn.Module, saved: Mapping[str, Any]) -> None:
    """Put an :func:`optimizer_state_by_name` back: group hyper-parameters, per-param state, loss scaler.

    Raises:
        CheckpointFormatError: the state is not keyed by name, or has another number of param groups.
    """
    layout.check_optimizer_entry(saved)
    saved_groups = saved[layout.PARAM_GROUPS]
    if len(saved_groups) != len(deepspeed_optimizer.param_groups):
        raise CheckpointFormatError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups, the one"
            f" `configure_optimizers` built now has {len(deepspeed_optimizer.param_groups)}. Resume with the same"
            " optimizer configuration and the same frozen/trainable split. (lightning-frozen 0.1 left groups whose"
            " params were all frozen out of its checkpoints, and out of its LR schedulers' state: resume such a"
            " checkpoint with 0.1, or load its weights alone with `lightning_frozen.load_adapter` and start the"
            " optimizer afresh.)"
        )
    for group, saved_group in zip(deepspeed_optimizer.param_groups, saved_groups):
        group.update(layout.group_hyper_parameters(saved_group))
    params = dict(module.named_parameters())
    ensure_optimizer_state(deepspeed_optimizer)
    for name, state in saved[layout.OPTIMIZER_STATE].items():
        if name in params and params[name].requires_grad and state:
            set_optimizer_state(deepspeed_optimizer, params[name], state)
    restore_loss_scaler(deepspeed_optimizer, saved.get(layout.LOSS_SCALER) or {})


def frozen_base_entry(
    module: nn.Module,
    anatomy: Anatomy,
    fingerprint: dict[str, Any],
    trainable_names: Optional[list[str]] = None,
) -> dict[str, Any]:
    """The ``frozen_base`` entry of ``module`` (of that ``anatomy``): reference, fingerprint, each base's reference
    where it holds several (a vision tower and a language model), what export needs for a PEFT model
    (``trainable_names``, the saved params' names, default: those that train) and how a quantized base is stored."""
    trainable_names = list(anatomy.trainable) if trainable_names is None else trainable_names
    buffer_names = list(persistent_buffers(module)) if anatomy.peft is not None else []
    exports = {} if anatomy.peft is None else peft_entries(anatomy, trainable_names, buffer_names)
    stored = sorted({frozen_dtype_of(p) for p in module.parameters() if not p.requires_grad} - {None})
    return layout.new_frozen_base_entry(
        anatomy.base_reference,
        fingerprint,
        bases=dict(anatomy.base_references),
        quantization=block_format(stored[0]).describe() if stored else None,
        **exports,
    )


def saved_checkpoint(
    checkpoint_dict: Mapping[str, Any],
    module: nn.Module,
    anatomy: Anatomy,
    fingerprint: dict[str, Any],
    **written_with: Any,
) -> dict[str, Any]:
    """The file a save writes: Lightning's ``checkpoint_dict`` (holding this package's ``state_dict`` and
    ``optimizer_states``), the ``frozen_base`` entry of ``module`` (of that ``anatomy``) and the format marker with
    ``written_with`` (world size, precision), built by :func:`layout.assemble`."""
    return layout.assemble(
        checkpoint_dict,
        checkpoint_dict[layout.STATE_DICT],
        checkpoint_dict.get(layout.OPTIMIZER_STATES),
        frozen_base_entry(module, anatomy, fingerprint),
        layout.format_marker(**written_with),
    )


def warn_if_stored_otherwise(checkpoint: Mapping[str, Any], frozen_dtype: Optional[str], source: Any) -> None:
    """Warn when a checkpoint was trained on a frozen base stored in another ``frozen_dtype`` than this run's; say in
    one line when it was stored in an older layout of the same format (the codes are made again from the base, in
    this layout, and decode to the same weights)."""
    recorded = layout.quantization_of(checkpoint)
    trained_as = recorded.get(layout.DTYPE)
    if trained_as != frozen_dtype:
        rank_zero_warn(
            f"lightning-frozen: {source} was trained on a frozen base stored as"
            f" {trained_as or 'unquantized'}, this run stores it as {frozen_dtype or 'unquantized'}"
            " (`frozen_dtype`): the adapter sees slightly different base weights than it was trained on."
        )
        return
    if frozen_dtype is None:
        return
    current = block_format(frozen_dtype).describe()
    changed = [
        key for key in (layout.BLOCK_SIZE, layout.SCALE_DTYPE, layout.PACKING) if recorded.get(key) != current.get(key)
    ]
    if changed == [layout.PACKING] and recorded.get(layout.PACKING) is None:
        rank_zero_info(
            f"lightning-frozen: {source} recorded its {frozen_dtype} base in the 0.1 layout (low nibble first); it is"
            f" encoded in this version's ({current[layout.PACKING]}): the same codes and weights, packed otherwise."
        )
    elif changed:
        rank_zero_warn(
            f"lightning-frozen: {source} stored its {frozen_dtype} base with other {', '.join(changed)}"
            f" ({', '.join(f'{recorded.get(k)!r}' for k in changed)}) than this version"
            f" ({', '.join(f'{current.get(k)!r}' for k in changed)}): it is encoded again from the base in this"
            " version's layout, and the adapter sees slightly different base weights than it was trained on."
        )
