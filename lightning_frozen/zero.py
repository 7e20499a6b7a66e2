"""Where ZeRO-3 puts frozen and trainable params, and reading/writing full trainable tensors under ZeRO-3.

DeepSpeed's ``offload_param`` moves every param to CPU memory, trainable ones too. We want only the frozen
shards there, so before ``deepspeed.initialize`` we convert the two sets with two ``deepspeed.zero.Init``
contexts: one whose ``remote_device`` is the CPU (frozen) and one that keeps shards on the accelerator
(trainable). DeepSpeed then finds every param already partitioned and leaves their placement alone; each
later all-gather copies a shard to the accelerator from wherever it lives.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from torch import nn

from lightning_frozen.errors import NoTrainableParametersError, UnsupportedConfigurationError

_DEEPSPEED_ACCELERATOR_OF = {CPUAccelerator: "cpu", CUDAAccelerator: "cuda"}


def align_deepspeed_accelerator(accelerator: Optional[Accelerator]) -> None:
    """Make DeepSpeed's accelerator match Lightning's, or raise if ``DS_ACCELERATOR`` pins another one."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    wanted = next((name for cls, name in _DEEPSPEED_ACCELERATOR_OF.items() if isinstance(accelerator, cls)), None)
    if wanted is None:
        raise UnsupportedConfigurationError(
            f"lightning-frozen runs DeepSpeed on `CUDAAccelerator` or `CPUAccelerator`, not"
            f" `{type(accelerator).__name__}`. Pass `accelerator='gpu'` or `accelerator='cpu'` to the Trainer."
        )
    current = get_accelerator()._name
    if current == wanted:
        return
    pinned = os.environ.get("DS_ACCELERATOR")
    if pinned:
        raise UnsupportedConfigurationError(
            f"Lightning trains on `{type(accelerator).__name__}` but `DS_ACCELERATOR={pinned}` makes DeepSpeed use"
            f" its `{current}` accelerator. Unset DS_ACCELERATOR or set it to `{wanted}`, or change the Trainer's"
            " `accelerator`."
        )
    if wanted == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        set_accelerator(CUDA_Accelerator())


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


def is_partitioned(param: nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def compute_dtype(config: dict) -> Optional[torch.dtype]:
    """The dtype DeepSpeed computes in for this config: bf16, fp16, or None for fp32."""
    if (config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return None


# Lightning's DeepSpeedStrategy default `reduce_bucket_size`, in elements
LIGHTNING_REDUCE_BUCKET_SIZE = 200_000_000


def fit_reduce_bucket(config: dict, trainable_numel: int) -> None:
    """Size ZeRO-3's gradient reduce bucket to the trainable elements when they are fewer than the default.

    ZeRO-3 allocates the bucket (``reduce_bucket_size`` elements) up front and only trainable gradients pass
    through it: with Lightning's default of 2e8 that is 763 MiB in fp32 (381 MiB in bf16) for any adapter.
    """
    zero_config = config.setdefault("zero_optimization", {})
    zero_config["reduce_bucket_size"] = fitted_reduce_bucket(trainable_numel)


def fitted_reduce_bucket(trainable_numel: int) -> int:
    """The reduce bucket ``frozen_deepspeed`` uses: Lightning's default, or the trainable elements if fewer."""
    return int(min(LIGHTNING_REDUCE_BUCKET_SIZE, max(trainable_numel, 1)))


def shard_range(param: nn.Parameter) -> tuple[int, int]:
    """``(start, count)``: the flat elements of a ZeRO-3 param this rank's shard holds.

    A shard is a contiguous range of the flattened tensor, padded at the end: ``count`` is less than the shard's
    size on the last ranks when the size is not a multiple of the world size (0 when only padding is left).
    """
    import deepspeed.comm as dist

    size = int(getattr(param.ds_tensor, "ds_numel", param.ds_tensor.numel()))
    start = size * dist.get_rank(group=param.ds_process_group)
    return start, max(0, min(size, int(param.ds_numel) - start))


def place_shards(model: nn.Module, device: torch.device, offload_frozen: bool, dtype: torch.dtype) -> None:
    """Put each ZeRO-3 shard where it belongs, in the compute ``dtype``: frozen ones in CPU memory if
    ``offload_frozen``, else on ``device``; trainable ones on ``device``.

    Params built under ``deepspeed.zero.Init`` (``configure_model``) keep the placement and dtype they were built
    with (a bf16 checkpoint stays bf16 under fp32 training), and DeepSpeed moves neither them nor the module later
    ("zero.Init handles device placement"); its ZeRO-3 optimizer needs every trainable shard in one dtype.
    """
    cpu = torch.device("cpu")
    for param in model.parameters():
        if not is_partitioned(param):
            continue
        target = cpu if offload_frozen and not param.requires_grad else device
        cast = param.ds_tensor.is_floating_point() and param.ds_tensor.dtype != dtype
        if param.ds_tensor.device != target or cast:
            param.ds_tensor.data = param.ds_tensor.data.to(target, dtype=dtype if cast else None)
        if cast:
            param.data = torch.empty(0, dtype=dtype, device=param.data.device)


def place_buffers(model: nn.Module, device: torch.device) -> None:
    """Move every buffer (and torchmetrics state) of ``model`` to ``device``, leaving params alone.

    DeepSpeed skips ``module.to(device)`` for a model whose params are already ZeRO-3 params, and Lightning does
    not move it either, so without this BERT's ``position_ids``, BatchNorm statistics or rotary ``inv_freq`` would
    stay where the model was built.
    """
    for module in model.modules():
        if _is_metric(module):
            module.to(device)  # torchmetrics keeps its states outside `_buffers` and moves them in `_apply`
            continue
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _is_metric(module: nn.Module) -> bool:
    metrics = sys.modules.get("torchmetrics")  # no torchmetrics imported, no metric in the model
    return metrics is not None and isinstance(module, metrics.Metric)


def partition_frozen_and_trainable(model: nn.Module, config: dict, offload_frozen: bool, pin_memory: bool) -> None:
    """Turn the model's params into ZeRO-3 shards: frozen ones in CPU memory if ``offload_frozen``.

    Params already partitioned (built under ``deepspeed.zero.Init``) keep their placement. With
    ``offload_param`` in the config DeepSpeed offloads everything itself and nothing is done here.
    """
    import deepspeed

    if not offload_frozen or (config.get("zero_optimization") or {}).get("offload_param"):
        return
    pending = [p for p in model.parameters() if not is_partitioned(p)]
    if not pending:
        return
    dtype = compute_dtype(config)
    if dtype is not None:
        # ZeRO-3 expects pre-partitioned params to be in the compute dtype already; the engine only checks.
        for param in pending:
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    frozen = [p for p in pending if not p.requires_grad]
    trainable = [p for p in pending if p.requires_grad]
    for params, remote_device in ((frozen, "cpu"), (trainable, None)):
        if params:
            deepspeed.zero.Init(
                module=nn.ParameterList(params),
                remote_device=remote_device,
                pin_memory=pin_memory and remote_device == "cpu",
                config_dict_or_path=config,
                dtype=dtype or torch.float32,
            )


def release_frozen_persistence(engine: Any, model: nn.Module) -> None:
    """Keep frozen params as 1/N shards at all times.

    ZeRO-3 keeps small params (below ``stage3_param_persistence_threshold``) gathered whole on every rank after
    their first use. That speeds up small trainable params, but a frozen one would then be held in full on every
    rank, so frozen params are taken out of the persistent set and re-partitioned.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    offload = getattr(engine.optimizer, "parameter_offload", None) or getattr(engine, "optimizer", None)
    persistent = getattr(offload, "persistent_parameters", None)
    if persistent is not None:
        persistent[:] = [p for p in persistent if p.requires_grad]
    for param in model.parameters():
        if param.requires_grad or not is_partitioned(param):
            continue
        param.ds_persist = False
        if param.ds_status == ZeroParamStatus.AVAILABLE:
            param.partition()


# ---------------------------------------------------------------------------------------------- full tensors


def full_param(param: nn.Parameter, deepspeed_optimizer: Any = None) -> torch.Tensor:
    """The whole value of a param on the CPU; the fp32 master copy when the ZeRO optimizer holds one.

    Collective under ZeRO-3: every rank must call it for the same params in the same order.
    """
    if deepspeed_optimizer is not None and param.requires_grad and is_partitioned(param):
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(param).detach().reshape(param.ds_shape).cpu()
    if is_partitioned(param):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().clone().cpu()
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
        _set_fp32_partition(deepspeed_optimizer, param, flat)


def _set_fp32_partition(
    deepspeed_optimizer: Any, param: nn.Parameter, value: torch.Tensor, key: Optional[str] = None
) -> None:
    """Write this rank's part of a whole fp32 value (the master weight, or optimizer state ``key``).

    DeepSpeed 0.19's ``safe_set_full_fp32_param``/``safe_set_full_optimizer_state`` narrow past the end of the value
    on the last rank when a param's size is not a multiple of the world size; this writes only the valid part.
    """
    partition, group_index = deepspeed_optimizer._get_fp32_opt_state_partition(
        param, release_swap_buffers=False, optim_state_key=key
    )
    flat = value.detach().reshape(-1)
    start, valid = shard_range(param)  # the fp32 partition is as long as the param's shard
    with torch.no_grad():
        partition.narrow(0, 0, valid).copy_(flat.narrow(0, start, valid).to(partition.dtype))
    if deepspeed_optimizer._swappable_optimizer_subgroup(group_index):
        deepspeed_optimizer._optimizer_states_and_gradient_swap_out(group_index)


def _inner_state(deepspeed_optimizer: Any, param: nn.Parameter) -> dict:
    """The inner torch optimizer's state of the fp32 flat partition that holds ``param``."""
    group_index, _, _ = deepspeed_optimizer.grad_position[deepspeed_optimizer.get_param_id(param)]
    flat = deepspeed_optimizer.fp32_partitioned_groups_flat[group_index]
    return deepspeed_optimizer.optimizer.state.get(flat, {})


def _is_per_element(value: Any) -> bool:
    # per-element state (Adam's moments) is a flat 1-D partition; scalars such as `step` are 0-D or numbers
    return torch.is_tensor(value) and value.dim() > 0


def optimizer_state_of(deepspeed_optimizer: Any, param: nn.Parameter) -> dict[str, Any]:
    """One trainable param's optimizer state, whole and world-size independent: per-element tensors are gathered,
    scalars (``step``) copied. Empty before the first step. Collective under ZeRO-3."""
    from deepspeed.utils import safe_get_full_optimizer_state

    state: dict[str, Any] = {}
    inner = _inner_state(deepspeed_optimizer, param)
    for key in sorted(inner):
        value = inner[key]
        if _is_per_element(value):
            state[key] = safe_get_full_optimizer_state(param, key).detach().reshape(param.ds_shape).cpu()
        else:
            state[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    return state


def ensure_optimizer_state(deepspeed_optimizer: Any, params: Optional[list[nn.Parameter]] = None) -> None:
    """Create the inner optimizer's lazily made state (Adam's moments) so it can be overwritten on resume.

    ZeRO-3 creates it at the first step; until then ``safe_set_full_optimizer_state`` raises ``KeyError``. We run
    one step per sub-group with zero gradients at learning rate 0 and put the fp32 partitions back as they were
    afterwards: an optimizer that ignores the group's ``lr`` (Adafactor's ``relative_step``) or decays weights
    would otherwise move them. The state it creates is overwritten by the checkpoint's right after. With ``params``,
    only their sub-groups are touched, so a group of newly trainable params starts its state (and step count) fresh
    at its first real step.
    """
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
            _set_fp32_partition(deepspeed_optimizer, param, value, key)
        elif torch.is_tensor(value) and torch.is_tensor(inner.get(key)):
            inner[key] = value.to(device=inner[key].device, dtype=inner[key].dtype).clone()
        else:
            inner[key] = value


# what DeepSpeed's loss scaler changes as training goes (the dynamic fp16 scale); its settings come from the config
_LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scaler_state(deepspeed_optimizer: Any) -> dict[str, Any]:
    """The ZeRO optimizer's loss-scaler state as plain numbers (scale, iteration, last overflow, hysteresis left).

    Under ``16-mixed`` it is DeepSpeed's dynamic loss scale, which a resume must continue; otherwise a constant 1.
    """
    scaler = getattr(deepspeed_optimizer, "loss_scaler", None)
    state: dict[str, Any] = {}
    for key in _LOSS_SCALER_STATE:
        value = getattr(scaler, key, None)
        value = value.item() if torch.is_tensor(value) else value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            state[key] = value
    return state


def restore_loss_scaler(deepspeed_optimizer: Any, state: dict[str, Any]) -> None:
    """Set the loss-scaler state :func:`loss_scaler_state` returned; keys the scaler does not have are skipped."""
    scaler = getattr(deepspeed_optimizer, "loss_scaler", None)
    for key, value in state.items():
        if key in _LOSS_SCALER_STATE and hasattr(scaler, key):
            setattr(scaler, key, value)


def detach_frozen_shards(params: list[nn.Parameter], offload: bool) -> None:
    """Give params that just stopped training shards of their own (in CPU memory if ``offload``).

    A trainable param's shard is a view into its ZeRO optimizer's flat buffer; once frozen it must not keep that
    buffer alive, nor stay on the accelerator when frozen shards are offloaded.
    """
    for param in params:
        if is_partitioned(param):
            device = torch.device("cpu") if offload else param.ds_tensor.device
            param.ds_tensor.data = param.ds_tensor.data.to(device, copy=True)
