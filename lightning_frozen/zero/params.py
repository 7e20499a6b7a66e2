"""ZeRO-3 params and whole tensors: a param's shard, size, shape and gather status (its ``ds_*`` attributes); reading
and writing its full value, its fp32 master copy and its optimizer state through the shards of any number of ranks,
and the loss scaler; and the dtype a DeepSpeed config computes in.

A ZeRO-3 partition is a contiguous range of the flattened tensor, padded at the end (:func:`shard_range`). Where the
shards live is ``engine.py``'s concern.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_frozen.capabilities import SCALER_RESUME, available
from lightning_frozen.errors import NoTrainableParametersError, format_names


def compute_dtype(config: dict) -> Optional[torch.dtype]:
    """The dtype DeepSpeed computes in for this config: bf16, fp16, or None for fp32."""
    if (config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return None


def check_has_trainable(module: nn.Module) -> None:
    """Raise :class:`NoTrainableParametersError` when every parameter of ``module`` is frozen."""
    params = list(module.parameters())
    if not params:
        raise NoTrainableParametersError(
            f"`{type(module).__name__}` has no parameters at all, so there is nothing to train or shard. Build the"
            " model in `__init__` or `configure_model` before `trainer.fit`."
        )
    if not any(p.requires_grad for p in params):
        raise NoTrainableParametersError(
            f"`{type(module).__name__}` has {len(params)} parameters and none requires grad, so there is nothing"
            " to train. Unfreeze the part you want to train (for PEFT: `get_peft_model(...)` marks the adapter"
            " trainable) before `trainer.fit`."
        )


def full_numel(param: nn.Parameter) -> int:
    """Number of elements of the whole param, also when ZeRO-3 has partitioned it away."""
    return int(getattr(param, "ds_numel", param.numel()))


def full_shape(param: nn.Parameter) -> torch.Size:
    """Shape of the whole param, also when ZeRO-3 has partitioned it away."""
    return getattr(param, "ds_shape", param.shape)


def is_partitioned(param: nn.Parameter) -> bool:
    """Whether ``param`` is a ZeRO-3 param (DeepSpeed has given it an id and a shard)."""
    return hasattr(param, "ds_id")


def local_shard(param: nn.Parameter) -> torch.Tensor:
    """The tensor holding this rank's part of ``param``: its ZeRO-3 shard (flat, padded at the end, see
    :func:`shard_range`; write into it to change what the rank stores), or the param's own data when it has none."""
    shard: Optional[torch.Tensor] = getattr(param, "ds_tensor", None)
    return param.data if shard is None else shard


def shard_numel(param: nn.Parameter) -> int:
    """Elements of this rank's ZeRO-3 shard of ``param``, padding included (the same on every rank)."""
    return int(getattr(param.ds_tensor, "ds_numel", param.ds_tensor.numel()))


def shard_range(param: nn.Parameter) -> tuple[int, int]:
    """``(start, count)``: the flat elements of a ZeRO-3 param this rank's shard holds.

    A shard is a contiguous range of the flattened tensor, padded at the end: ``count`` is less than the shard's
    size on the last ranks when the size is not a multiple of the world size (0 when only padding is left).
    """
    import deepspeed.comm as dist

    size = shard_numel(param)
    start = size * dist.get_rank(group=param.ds_process_group)
    return start, max(0, min(size, int(param.ds_numel) - start))


def is_released(param: nn.Parameter) -> bool:
    """Whether a ZeRO-3 param holds only its shard now (not gathered, nor being gathered)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status == ZeroParamStatus.NOT_AVAILABLE


def mark_gathered(param: nn.Parameter, whole: torch.Tensor) -> None:
    """Finish a gather of ``param`` as DeepSpeed's own does: ``whole`` (its full value, in its dtype and shape) becomes
    its data, and the param counts as available until DeepSpeed partitions it again. A per-param gather that replaces
    DeepSpeed's (``all_gather``, ``all_gather_coalesced``) ends with this."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    param.data = whole
    param.ds_status = ZeroParamStatus.AVAILABLE


@contextmanager
def gathered(param: nn.Parameter) -> Iterator[None]:
    """While active, ``param.data`` holds the whole value of a ZeRO-3 param on every rank, to read (writes are
    dropped); a plain tensor is left as it is. Collective under ZeRO-3."""
    if not is_partitioned(param):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        yield


# ---------------------------------------------------------------------------------------------- full tensors


@contextmanager
def placeholder_on_accelerator(param: nn.Parameter) -> Iterator[None]:
    """While active, a ZeRO-3 param's empty placeholder (``param.data``) is on the accelerator: DeepSpeed's
    ``safe_get_full_*`` gather onto its device, which Lightning's teardown moved (docs/internals.md)."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    placeholder = param.data
    if placeholder.device == device:
        yield
        return
    param.data = torch.empty(0, dtype=placeholder.dtype, device=device)
    try:
        yield
    finally:
        param.data = placeholder


def full_param(param: nn.Parameter, deepspeed_optimizer: Any = None) -> torch.Tensor:
    """The whole value of a param on the CPU; the fp32 master copy when the ZeRO optimizer holds one.

    Collective under ZeRO-3: every rank must call it for the same params in the same order.
    """
    if deepspeed_optimizer is not None and param.requires_grad and is_partitioned(param):
        from deepspeed.utils import safe_get_full_fp32_param

        with placeholder_on_accelerator(param):
            return safe_get_full_fp32_param(param).detach().reshape(param.ds_shape).cpu()
    with gathered(param):
        return param.detach().clone().cpu()


def set_full_param(param: nn.Parameter, value: torch.Tensor, deepspeed_optimizer: Any = None) -> None:
    """Write a whole value into a param: this rank's ZeRO-3 shard, and the fp32 master copy if there is one."""
    if not is_partitioned(param):
        with torch.no_grad():
            param.copy_(value.to(device=param.device, dtype=param.dtype).reshape(param.shape))
        return
    flat = value.detach().reshape(-1)
    shard = param.ds_tensor
    start, valid = shard_range(param)
    with torch.no_grad():
        shard.narrow(0, 0, valid).copy_(flat.narrow(0, start, valid).to(device=shard.device, dtype=shard.dtype))
    if deepspeed_optimizer is not None and param.requires_grad:
        _set_full_fp32(param, flat)


def _set_full_fp32(param: nn.Parameter, value: torch.Tensor, key: Optional[str] = None) -> None:
    """Write this rank's part of a whole fp32 value (master weight, or optimizer state ``key``): ``safe_set_full_*``."""
    from deepspeed import utils

    if shard_range(param)[1] < shard_numel(param):  # the partition ends in padding, which DeepSpeed's setters overrun
        _set_padded_partition(param, value, key)
    elif key is None:
        utils.safe_set_full_fp32_param(param, value)
    else:
        utils.safe_set_full_optimizer_state(param, value, key)


def _set_padded_partition(param: nn.Parameter, value: torch.Tensor, key: Optional[str]) -> None:
    """Write the valid part of a whole fp32 value into this rank's partition, which ends in padding (kept as it is):
    DeepSpeed's ``safe_set_full_*`` overrun it (docs/internals.md)."""
    from deepspeed import utils

    start, valid = shard_range(param)
    partition = _local_partition(param, key).detach().clone()
    partition.narrow(0, 0, valid).copy_(value.detach().reshape(-1).narrow(0, start, valid))
    if key is None:
        utils.safe_set_local_fp32_param(param, partition)
    else:
        utils.safe_set_local_optimizer_state(param, partition, key)


def _local_partition(param: nn.Parameter, key: Optional[str]) -> torch.Tensor:
    """This rank's fp32 partition (padding included) of a trainable ZeRO-3 param, or of its optimizer state ``key``."""
    from deepspeed import utils

    return utils.safe_get_local_fp32_param(param) if key is None else utils.safe_get_local_optimizer_state(param, key)


def _fp32_flat(deepspeed_optimizer: Any, param: nn.Parameter) -> torch.Tensor:
    """The ZeRO-3 optimizer's fp32 flat partition (of its sub-group) that holds ``param``'s part."""
    group_index, _, _ = deepspeed_optimizer.grad_position[deepspeed_optimizer.get_param_id(param)]
    return deepspeed_optimizer.fp32_partitioned_groups_flat[group_index]


def _inner_state(deepspeed_optimizer: Any, param: nn.Parameter) -> dict:
    """The inner torch optimizer's state of the fp32 flat partition that holds ``param`` (its keys, ``step``)."""
    return deepspeed_optimizer.optimizer.state.get(_fp32_flat(deepspeed_optimizer, param), {})


def _is_per_element(value: Any) -> bool:
    # per-element state (Adam's moments) is a flat 1-D partition; scalars such as `step` are 0-D or numbers
    return torch.is_tensor(value) and value.dim() > 0


def optimizer_state_of(deepspeed_optimizer: Any, param: nn.Parameter) -> dict[str, Any]:
    """One trainable param's optimizer state, whole and world-size independent: per-element tensors are gathered,
    scalars (``step``) copied. Empty before the first step. Collective under ZeRO-3."""
    from deepspeed.utils import safe_get_full_optimizer_state

    def whole(key: str) -> torch.Tensor:
        with placeholder_on_accelerator(param):
            return safe_get_full_optimizer_state(param, key).detach().reshape(param.ds_shape).cpu()

    return optimizer_state_with(deepspeed_optimizer, param, whole)


def optimizer_state_with(
    deepspeed_optimizer: Any, param: nn.Parameter, per_element: Callable[[str], Any]
) -> dict[str, Any]:
    """:func:`optimizer_state_of` with each per-element state (Adam's moments) ``per_element(key)`` instead, in order;
    scalars (``step``) copied."""
    state: dict[str, Any] = {}
    inner = _inner_state(deepspeed_optimizer, param)
    for key in sorted(inner):
        value = inner[key]
        if _is_per_element(value):
            state[key] = per_element(key)
        else:
            state[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    return state


WRITER_RANK = 0  # the rank that writes a checkpoint file, and the only one a save gathers whole tensors to


def whole_on_meta(param: nn.Parameter, deepspeed_optimizer: Any = None, key: Optional[str] = None) -> torch.Tensor:
    """A tensor on the meta device of the shape and dtype :func:`gather_to_writer` returns for the same arguments:
    what a save puts in its dict until the file is written."""
    dtype = _partition_of(param, deepspeed_optimizer, key).dtype
    return torch.empty(full_shape(param), dtype=dtype, device="meta")


def gather_to_writer(
    param: nn.Parameter, deepspeed_optimizer: Any = None, key: Optional[str] = None
) -> Optional[torch.Tensor]:
    """The whole value of a trainable param on the CPU of the writing rank (:data:`WRITER_RANK`), None on the others:
    the fp32 master copy where the ZeRO optimizer holds one (else the param itself), or with ``key`` its optimizer
    state ``key``. Each rank sends its own partition and only the writer holds the whole, one param at a time
    (``safe_get_full_fp32_param`` would give it to every rank). Collective under ZeRO-3."""
    import deepspeed.comm as dist

    writer = dist.get_rank() == WRITER_RANK
    if not is_partitioned(param):
        return param.detach().cpu() if writer else None
    from deepspeed.accelerator import get_accelerator

    # the partition is as long as the shard on every rank (padding included); gloo and NCCL want it on the accelerator
    partition = _partition_of(param, deepspeed_optimizer, key).to(get_accelerator().current_device_name())
    group, ranks = param.ds_process_group, dist.get_world_size(group=param.ds_process_group)
    whole = torch.empty(partition.numel() * ranks, dtype=partition.dtype, device=partition.device) if writer else None
    # gather_list[i] receives the partition of the group's rank i: the ranks' shards in order, padding at the end
    dist.gather(partition, gather_list=list(whole.chunk(ranks)) if writer else None, dst=WRITER_RANK, group=group)
    return whole.narrow(0, 0, full_numel(param)).view(full_shape(param)).cpu() if writer else None


def _partition_of(param: nn.Parameter, deepspeed_optimizer: Any, key: Optional[str]) -> torch.Tensor:
    """This rank's flat partition of what :func:`gather_to_writer` gathers (the param's own data when it has none)."""
    if not is_partitioned(param):
        return param.data
    if deepspeed_optimizer is None or not param.requires_grad:
        return param.ds_tensor
    return _local_partition(param, key)


def ensure_optimizer_state(deepspeed_optimizer: Any, params: Optional[list[nn.Parameter]] = None) -> None:
    """Create the inner optimizer's lazily made state (Adam's moments) so it can be overwritten on resume: one step
    per sub-group (of ``params`` only, if given) at learning rate 0, the fp32 partitions put back after it."""
    inner = deepspeed_optimizer.optimizer
    flats = deepspeed_optimizer.fp32_partitioned_groups_flat
    wanted = (
        range(len(flats))
        if params is None
        else {deepspeed_optimizer.grad_position[deepspeed_optimizer.get_param_id(p)][0] for p in params}
    )
    missing = [i for i in sorted(wanted) if not inner.state.get(flats[i])]
    if not missing:
        return
    saved_lrs = [group["lr"] for group in inner.param_groups]
    for group in inner.param_groups:
        group["lr"] = 0.0
    try:
        for index in missing:
            # with optimizer offload the flat partition's .grad is DeepSpeed's own persistent buffer: reuse it
            persistent = flats[index].grad
            if persistent is None:
                flats[index].grad = torch.zeros_like(flats[index])
            else:
                persistent.zero_()
            weights = flats[index].detach().clone()
            deepspeed_optimizer._optimizer_step(index)
            with torch.no_grad():
                flats[index].copy_(weights)
            flats[index].grad = persistent
    finally:
        for group, lr in zip(inner.param_groups, saved_lrs):
            group["lr"] = lr


def set_optimizer_state(deepspeed_optimizer: Any, param: nn.Parameter, state: dict[str, Any]) -> None:
    """Write one param's whole optimizer state (from :func:`optimizer_state_of`) into this rank's partition."""
    inner = _inner_state(deepspeed_optimizer, param)
    for key, value in state.items():
        if _is_per_element(value):
            _set_full_fp32(param, value, key)
        elif torch.is_tensor(value) and torch.is_tensor(inner.get(key)):
            inner[key] = value.to(device=inner[key].device, dtype=inner[key].dtype).clone()
        else:
            inner[key] = value


# what DeepSpeed's loss scaler changes as training goes (the dynamic fp16 scale); its settings come from the config
_LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scaler_state(deepspeed_optimizer: Any) -> dict[str, Any]:
    """The ZeRO optimizer's loss-scaler state as plain numbers (scale, iteration, last overflow, hysteresis left);
    empty where ``capabilities.SCALER_RESUME`` is off."""
    if not available(SCALER_RESUME):
        return {}
    return scaler_state(getattr(deepspeed_optimizer, "loss_scaler", None))


def scaler_state(scaler: Any) -> dict[str, Any]:
    """:func:`loss_scaler_state` of a DeepSpeed ``LossScaler`` itself, as a ZeRO checkpoint directory stores it."""
    state: dict[str, Any] = {}
    for key in _LOSS_SCALER_STATE:
        value = getattr(scaler, key, None)
        value = value.item() if torch.is_tensor(value) else value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            state[key] = value
    return state


def restore_loss_scaler(deepspeed_optimizer: Any, state: dict[str, Any]) -> None:
    """Set the loss-scaler state :func:`loss_scaler_state` returned. Keys the scaler does not have (a run resumed in
    another precision than the saved one's) warn that the loss scale starts afresh, as does
    ``capabilities.SCALER_RESUME`` off."""
    if not state or not available(SCALER_RESUME):
        return
    scaler = getattr(deepspeed_optimizer, "loss_scaler", None)
    lacking = [key for key in state if key in _LOSS_SCALER_STATE and not hasattr(scaler, key)]
    if lacking:
        rank_zero_warn(
            f"lightning-frozen: the checkpoint holds DeepSpeed's loss-scaler state {format_names(lacking)}, which this"
            f" run's `{type(scaler).__name__}` does not keep, so its loss scale starts afresh. Resume with the"
            " precision the checkpoint was saved with to continue it."
        )
    for key, value in state.items():
        if key in _LOSS_SCALER_STATE and hasattr(scaler, key):
            setattr(scaler, key, value)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that ``state_dict()`` would save, by name."""
    saved = module.state_dict(keep_vars=True)  # references only: no param is gathered or copied
    return {
        name: buffer
        for prefix, submodule in module.named_modules()
        for name, buffer in submodule.named_buffers(prefix, recurse=False)
        if name in saved
    }


def storage_identity(tensor: torch.Tensor) -> tuple[int, int]:
    """Which storage ``tensor`` is and how often it was written in place (its ``_version``): a checksum taken of its
    values holds while both are unchanged."""
    return tensor.data_ptr(), tensor._version
