"""Where ZeRO-3 puts frozen and trainable params, and reading/writing full trainable tensors under ZeRO-3.

DeepSpeed's ``offload_param`` moves every param to CPU memory, trainable ones too. We want only the frozen
shards there, so before ``deepspeed.initialize`` we convert the two sets with two ``deepspeed.zero.Init``
contexts: one whose ``remote_device`` is the CPU (frozen) and one that keeps shards on the accelerator
(trainable). DeepSpeed then finds every param already partitioned and leaves their placement alone; each
later all-gather copies a shard to the accelerator from wherever it lives.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from torch import nn

from lightning_frozen.errors import NoTrainableParametersError

_DEEPSPEED_ACCELERATOR_OF = {CPUAccelerator: "cpu", CUDAAccelerator: "cuda"}


def align_deepspeed_accelerator(accelerator: Optional[Accelerator]) -> None:
    """Make DeepSpeed's accelerator match Lightning's, or raise if ``DS_ACCELERATOR`` pins another one."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    wanted = next((name for cls, name in _DEEPSPEED_ACCELERATOR_OF.items() if isinstance(accelerator, cls)), None)
    if wanted is None:
        raise RuntimeError(
            f"lightning-frozen runs DeepSpeed on `CUDAAccelerator` or `CPUAccelerator`, not"
            f" `{type(accelerator).__name__}`. Pass `accelerator='gpu'` or `accelerator='cpu'` to the Trainer."
        )
    current = get_accelerator()._name
    if current == wanted:
        return
    pinned = os.environ.get("DS_ACCELERATOR")
    if pinned:
        raise RuntimeError(
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
    if not any(p.requires_grad for p in params):
        raise NoTrainableParametersError(
            f"`{type(module).__name__}` has {len(params)} parameters and none requires grad, so there is nothing"
            " to train. Unfreeze the part you want to train (for PEFT: `get_peft_model(...)` marks the adapter"
            " trainable) before `trainer.fit`."
        )


def trainable_flags(module: nn.Module) -> dict[str, bool]:
    return {name: param.requires_grad for name, param in module.named_parameters()}


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
