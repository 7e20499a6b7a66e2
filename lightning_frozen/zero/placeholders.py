"""Shards that cost nothing until the sliced loader fills them: inside ``from_pretrained`` under ``zero.Init``, no
param is broadcast whole from rank 0 as its module is built (:func:`not_broadcast_while_loading`), and where the
loader stores codes (``frozen_dtype``) a shard is allocated without the copy that would write its every page. Why, and
what it saved: docs/internals.md, "What other packages and the file system do that the code works around".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch


@contextmanager
def untouched_while_loading(building: Callable[[], bool], enabled: bool = True) -> Iterator[None]:
    """While active, params built while ``building()`` is true (transformers' ``from_pretrained`` is inside its model's
    ``__init__`` under its ``zero.Init``) get shards that are allocated but never written (see the module docstring);
    other params are partitioned as DeepSpeed does."""
    if not enabled:
        yield
        return
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partition_parameters import Init, PartitionedParamStatus, ZeroParamStatus

    original = Init._partition_param

    def partition_param(
        self: Any, param: Any, buffer: Any = None, has_been_updated: bool = False, free_data: bool = True
    ) -> Any:
        plain = not (param.ds_persist or self.quantized_nontrainable_weights or self.remote_device == "nvme")
        if building() and plain and param.ds_tensor is None and param.ds_status is ZeroParamStatus.AVAILABLE:
            ranks = comm.get_world_size(group=self.get_partition_dp_group(param))
            size = -(-param.ds_numel // ranks)  # each rank's shard, the whole padded to a multiple of the ranks
            aligned = size * ranks
            shard = torch.empty(size, dtype=param.dtype, device=self.remote_device)
            if self.remote_device == OffloadDeviceEnum.cpu and self.pin_memory:
                shard = get_accelerator().pin_memory(shard)
            shard.requires_grad = False
            shard.ds_numel, shard.status, shard.final_location = shard.numel(), PartitionedParamStatus.AVAILABLE, None
            param.ds_tensor, param.ds_numel_aligned = shard, aligned
        # with a shard in place DeepSpeed takes the param as partitioned already: it only frees the full tensor
        return original(self, param, buffer, has_been_updated, free_data)

    with mock.patch.object(Init, "_partition_param", partition_param):  # put back whatever stops the load
        yield


@contextmanager
def not_broadcast_while_loading(building: Callable[[], bool], enabled: bool = True) -> Iterator[None]:
    """While active, params built while ``building()`` is true are partitioned without DeepSpeed's broadcast from
    rank 0 (see the module docstring); other params are converted as DeepSpeed does. Only where
    ``Init._zero_init_param`` is the three steps it replaces (DeepSpeed 0.19: convert, broadcast, partition)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._zero_init_param
    if not enabled or not _is_convert_broadcast_partition(original):
        yield
        return

    def zero_init_param(self: Any, param: Any) -> None:
        if not building():
            original(self, param)
            return
        self._convert_to_deepspeed_param(param)
        param.partition()

    with mock.patch.object(Init, "_zero_init_param", zero_init_param):  # put back whatever stops the load
        yield


def _is_convert_broadcast_partition(method: Callable[..., Any]) -> bool:
    """Whether DeepSpeed's ``Init._zero_init_param`` converts, broadcasts and partitions, and nothing else."""
    names = method.__code__.co_names
    return set(names) <= _ZERO_INIT_PARAM_NAMES and {"broadcast", "partition"} <= set(names)


# every global and attribute name DeepSpeed 0.19's `Init._zero_init_param` uses
_ZERO_INIT_PARAM_NAMES = {
    "_convert_to_deepspeed_param",
    "get_partition_dp_group",
    "dist",
    "get_world_group",
    "broadcast",
    "data",
    "view",
    "torch",
    "uint8",
    "get_global_rank",
    "partition",
}
