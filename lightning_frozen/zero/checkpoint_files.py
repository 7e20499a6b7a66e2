"""What is read from a checkpoint directory DeepSpeed's ZeRO-3 wrote: its shard files, the DeepSpeed classes they
pickle, and whole tensors reassembled from the ranks' flat partitions, with DeepSpeed 0.19's own ``zero_to_fp32``
(its public function for the weights, its private merge for the optimizer's moments).

Each rank writes ``*_model_states.pt`` (param shapes per group, buffers, frozen params' fragments, the client state)
and ``*_optim_states.pt`` (its fp32 flat partitions and the inner optimizer's state of them). ``zero_to_fp32`` loads
them with ``torch.load``: a caller that wants them loaded ``weights_only`` allows :func:`pickled_classes`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch


def shard_files(folder: Path) -> tuple[list[str], list[str]]:
    """The model-state files and the optimizer-state files in a DeepSpeed checkpoint ``folder``, in rank order.

    Raises:
        FileNotFoundError: ``folder`` holds no such files.
    """
    from deepspeed.utils import zero_to_fp32

    return zero_to_fp32.get_model_state_files(str(folder)), zero_to_fp32.get_optim_files(str(folder))


def pickled_classes() -> list[type]:
    """The DeepSpeed classes a ZeRO-3 checkpoint's files hold besides tensors and containers (the ZeRO stage enum and
    the loss scalers), to allow in ``torch.serialization.safe_globals``."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def read_model_states(files: list[str]) -> list[Any]:
    """Each rank's model states (``param_shapes`` per group, ``buffers``, frozen fragments), as ``zero_to_fp32``
    parses them from the model-state ``files``, loaded ``weights_only`` (allow :func:`pickled_classes` around it)."""
    from deepspeed.utils import zero_to_fp32

    with _weights_only_loads():
        return zero_to_fp32.parse_model_states(files)


@contextmanager
def _weights_only_loads() -> Iterator[None]:
    """``zero_to_fp32``'s ``torch.load(..., weights_only=False)`` made weights_only for the duration of the block:
    torch reads the override from the environment, restored on exit."""
    with mock.patch.dict(os.environ, TORCH_FORCE_WEIGHTS_ONLY_LOAD="1"):
        os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        yield


def read_fp32_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every whole tensor of the shard ``folder``, by name, with DeepSpeed's public
    ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``: the trainable params (their fp32 master weights), the
    frozen params (where the directory holds them) and the buffers, loaded ``weights_only`` (allow
    :func:`pickled_classes` around it)."""
    from deepspeed.utils import zero_to_fp32

    with _weights_only_loads():
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)


def merge_trainable(
    world_size: int, flat_groups: list[list[torch.Tensor]], model_states: list[Any]
) -> dict[str, torch.Tensor]:
    """Whole per-param tensors, by name, from each rank's flat partitions (``flat_groups[rank][group]``) of the
    trainable params, for one per-element optimizer state: through ``zero_to_fp32``'s private merge, since nothing
    public merges the moments in memory (docs/internals.md)."""
    from deepspeed.utils.zero_to_fp32 import _zero3_merge_trainable_params

    merged: dict[str, Any] = {}
    _zero3_merge_trainable_params(merged, world_size, flat_groups, model_states)
    return {name: tensor.contiguous().clone() for name, tensor in merged.items()}


# what DeepSpeed's engine writes into a model-states file next to Lightning's checkpoint dict, its `client_state`
# (`DeepSpeedEngine._common_checkpoint_state` and `_save_checkpoint`, 0.19); everything else there is Lightning's
ENGINE_STATE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "ds_config",
        "ds_version",
    }
)


def loss_scaler_of(optimizer_state: dict[str, Any]) -> Any:
    """The loss scaler a rank's optimizer-states file records (a ``LossScaler`` / ``DynamicLossScaler``)."""
    from deepspeed.checkpoint.constants import LOSS_SCALER

    return optimizer_state[LOSS_SCALER]
