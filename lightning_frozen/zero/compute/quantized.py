"""Frozen ZeRO-3 shards stored below the compute dtype (``frozen_dtype="int8"``, ``"nf4"``, or a ``"bf16"``/``"fp16"``
cast under fp32 compute; the codecs are in ``format/codec.py``): quantized at setup, gathered and decoded. The core
reaches it through ``zero/frozen_compute.py``; the storage itself is ``zero/frozen_storage.py``'s.

Each rank's shard of a frozen param is stored as one ``uint8`` tensor (the codes, then the scales' bytes) in place of
its compute-dtype shard. Gathering it all-gathers those bytes and decodes them, on the device that computes; releasing
it frees the full tensor as for any ZeRO-3 param. DeepSpeed's machinery is kept, the storage and the gather are ours
(``ds_quant_scale`` routes the param to its own ``all_gather_coalesced``; why not ZeRO++: docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.errors import FrozenDtypeError
from lightning_frozen.format.codec import block_format, decode
from lightning_frozen.format.native_codec import KERNELS, empty_output
from lightning_frozen.zero import frozen_files, gathers
from lightning_frozen.zero.compute.coded_linear import CodedLayers
from lightning_frozen.zero.compute.host_memory import DecodeBuffers
from lightning_frozen.zero.frozen_storage import SourceValues, frozen_dtype_of, store_codes
from lightning_frozen.zero.params import (
    full_shape,
    is_partitioned,
    is_released,
    mark_gathered,
    shard_numel,
    shard_range,
)


@dataclass(frozen=True)
class RunTables:
    """What the gathers of one run's codes share, handed to each gather the run installs: the layers computed from
    their codes, and the decoded tensors kept for the next gather (both used on the CPU only). A run's compute object
    makes them (``zero/frozen_compute.py``); no module holds them, so two runs in one process never share them."""

    layers: CodedLayers = field(default_factory=CodedLayers)
    buffers: DecodeBuffers = field(default_factory=DecodeBuffers)


def quantize_frozen_shards(
    model: nn.Module, frozen_dtype: str, tables: RunTables, before_encoding: Optional[SourceValues] = None
) -> int:
    """Store every frozen ZeRO-3 param's shard of ``model`` quantized in ``frozen_dtype``, in turn, where it lives;
    return how many it did. ``before_encoding`` is told each shard's values first (and a param's written later);
    params quantized before are not quantized again, and every gather uses this run's ``tables``. Collective when
    ``before_encoding`` is.

    Raises:
        FrozenDtypeError: a quantized param was made trainable (its source values are gone), or a frozen param is
            not a ZeRO-3 param or not released.
    """
    fmt = block_format(frozen_dtype)
    done = 0
    for name, param in model.named_parameters():
        stored_as = frozen_dtype_of(param)
        if param.requires_grad:
            if stored_as is not None:
                raise FrozenDtypeError(
                    f"`{name}` is stored quantized (`frozen_dtype={stored_as!r}`) and cannot be trained: only its"
                    f" {stored_as} codes are left. Keep it frozen, or train with `frozen_dtype=None`."
                )
            continue
        if stored_as is not None:
            install_quantized_gather(param, tables, before_encoding)
            continue
        if not is_partitioned(param) or not is_released(param):
            raise FrozenDtypeError(
                f"`{name}` is frozen but not a released ZeRO-3 shard, so it cannot be stored as {fmt.name}."
                " `frozen_dtype` needs ZeRO stage 3 (`stage=3`, the default)."
            )
        quantize_param_shard(param, fmt.name, tables, before_encoding)
        done += 1
    return done


def quantize_param_shard(
    param: nn.Parameter, frozen_dtype: str, tables: RunTables, before_encoding: Optional[SourceValues] = None
) -> None:
    """Quantize one released ZeRO-3 param's shard (see :func:`quantize_frozen_shards`).

    Raises:
        FrozenDtypeError: ``param`` requires grad: trainable params keep their compute dtype.
    """
    if param.requires_grad:
        raise FrozenDtypeError(
            f"A trainable param (shape {tuple(full_shape(param))}) cannot be stored as"
            f" {frozen_dtype}: only frozen params (`requires_grad=False`) are quantized. Freeze it first"
            " (`requires_grad_(False)`) or leave it out of the frozen base."
        )
    start, count = shard_range(param)
    values = param.ds_tensor.detach().reshape(-1)[:count]
    if before_encoding is not None:
        before_encoding(param, values, start, None)
    store_codes(param, values, frozen_dtype, KERNELS)
    install_quantized_gather(param, tables, before_encoding)


def install_quantized_gather(
    param: nn.Parameter, tables: RunTables, before_encoding: Optional[SourceValues] = None
) -> None:
    """Gather and partition ``param`` (its shard already holds codes) through the quantized gather
    (``zero/gathers.py``'s :data:`~lightning_frozen.zero.gathers.QUANTIZED`), with the run's ``tables``; a write to it
    tells ``before_encoding`` the new values before they are encoded."""
    original_partition = gathers.deepspeed_method(param, "partition")

    def all_gather_coalesced(params: Iterable[nn.Parameter], safe_mode: bool = False, quantize: bool = False) -> Any:
        params = list(params)
        others = [p for p in params if frozen_dtype_of(p) is None]
        handles = [_gather([p for p in params if frozen_dtype_of(p) is not None], tables, for_layer=True)]
        if others:
            handles.append(others[0].all_gather_coalesced(others, safe_mode=safe_mode, quantize=quantize))
        return _Handles(handles)

    def all_gather(param_list: Optional[list] = None, async_op: bool = False, hierarchy: int = 0) -> Any:
        param_list = [param] if param_list is None else list(param_list)
        ours = [p for p in param_list if frozen_dtype_of(p) is not None and is_released(p)]
        others = [p for p in param_list if frozen_dtype_of(p) is None]
        for p in param_list:  # gathered for its layer as codes: whole values are wanted here
            tables.layers.decode_whole(p)
        _gather(ours, tables).wait()
        if others:
            return others[0].all_gather(param_list=others, async_op=async_op, hierarchy=hierarchy)
        return [] if async_op else None

    def partition(
        param_list: Optional[list] = None, hierarchy: int = 0, has_been_updated: bool = False, free_data: bool = True
    ) -> None:
        param_list = [param] if param_list is None else list(param_list)
        ours = [p for p in param_list if frozen_dtype_of(p) is not None]
        others = [p for p in param_list if frozen_dtype_of(p) is None]
        if has_been_updated:
            for p in ours:  # written under GatheredParameters(modifier_rank=...): quantize this rank's new slice
                _requantize_from_full(p, before_encoding)
        if ours:
            coded = {id(p) for p in ours if tables.layers.drop_codes(p)}  # their data is a placeholder
            decoded = [p.data for p in ours if p.data.numel() == p.ds_numel > 0 and id(p) not in coded]
            original_partition(param_list=ours, hierarchy=hierarchy, has_been_updated=False, free_data=free_data)
            while decoded:  # each on its own, so that only the one offered holds a reference
                tables.buffers.give(decoded.pop())
        if others:
            others[0].partition(
                param_list=others, hierarchy=hierarchy, has_been_updated=has_been_updated, free_data=free_data
            )

    methods = {"all_gather": all_gather, "all_gather_coalesced": all_gather_coalesced, "partition": partition}
    gathers.use(param, gathers.QUANTIZED, methods)


def _requantize_from_full(param: nn.Parameter, before_encoding: Optional[SourceValues]) -> None:
    frozen_dtype = frozen_dtype_of(param)
    assert frozen_dtype is not None
    start, count = shard_range(param)
    piece = param.data.detach().reshape(-1)[start : start + count].to(param.ds_tensor.device)
    if before_encoding is not None:
        before_encoding(param, piece, start, param.data)
    store_codes(param, piece, frozen_dtype, KERNELS)


class _Handles:
    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


class _GatherHandle:
    """A quantized gather in flight, as DeepSpeed's ``AllGatherCoalescedHandle`` is: ``wait`` finishes the collectives,
    decodes each param whole (a layer computing from codes keeps them, ``coded_linear.py``) and marks it available,
    once: DeepSpeed waits on a handle shared by several params again after some of them were released."""

    def __init__(
        self,
        groups: list[tuple[list[tuple[nn.Parameter, torch.Tensor]], Any]],
        sent: list[torch.Tensor],
        tables: RunTables,
        for_layer: bool = False,
    ):
        self.groups = groups  # per process group: each param with its gathered rows (one per rank), and the work
        self.sent = sent  # the local codes each collective sends, alive until it is done
        self.tables = tables
        self.for_layer = for_layer  # gathered by ZeRO-3's hooks for a module's forward or backward
        self.complete = False

    def wait(self, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        for params, work in self.groups:
            if work is not None:
                work.wait()
            for param, rows in params:
                frozen_dtype = frozen_dtype_of(param)
                assert frozen_dtype is not None
                numel = shard_numel(param)
                layers = self.tables.layers
                if self.for_layer and rows.device.type == "cpu" and layers.computes_from_codes(param):
                    mark_gathered(param, layers.keep_codes(param, rows, numel, frozen_dtype))
                    continue
                out = None
                if rows.device.type == "cpu":
                    out = self.tables.buffers.take(rows.shape[0] * numel, param.dtype, asker=id(param))
                values = decode(rows, numel, frozen_dtype, param.dtype, out=out, kernels=KERNELS)
                mark_gathered(param, values[: param.ds_numel].view(param.ds_shape))
        self.groups, self.sent = [], []  # the codes are garbage once decoded
        self.complete = True


_SHARED = -1  # the group of params whose codes every rank reads from shared memory


def _gather(params: list[nn.Parameter], tables: RunTables, for_layer: bool = False) -> _GatherHandle:
    """Start all-gathering the encoded shards of ``params`` (one collective per process group, asynchronous) and
    return the handle whose ``wait`` decodes each param whole, in its compute dtype, on the accelerator. Every rank
    passes the same params (sorted here by ``ds_id``). A group of one rank decodes each shard where it lies, as do
    params whose every rank's codes are in a file this machine's ranks map (``zero/frozen_files.py``): nothing is
    sent.
    ``for_layer``: gathered by ZeRO-3's hooks for a module, so a weight computed from its codes keeps them."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    device = torch.device(get_accelerator().current_device_name())
    by_group: dict[int, list[nn.Parameter]] = {}
    for param in sorted(params, key=lambda p: p.ds_id):
        # DeepSpeed's own gather asserts the same: only released params are fetched
        assert is_released(param), f"expected a released param, got {param.ds_summary()}"
        param.ds_status = ZeroParamStatus.INFLIGHT
        frozen_files.read_ahead(param)  # a mapped file's next pages, read from disk while this one computes
        key = _SHARED if frozen_files.rows_of(param) is not None else id(param.ds_process_group)
        by_group.setdefault(key, []).append(param)
    groups, sent = [], []
    shared = [(p, frozen_files.rows_of(p)) for p in by_group.pop(_SHARED, [])]
    if shared:  # every rank's codes already in a file this machine's ranks map
        groups.append((shared, None))
    for group_params in by_group.values():
        group = group_params[0].ds_process_group
        world_size = dist.get_world_size(group=group)
        if world_size == 1:  # nothing to exchange: no concatenated copy of the codes
            shards = [(p, p.ds_tensor.data.to(device, non_blocking=True).view(1, -1)) for p in group_params]
            groups.append((shards, None))
            continue
        pieces = [p.ds_tensor.data.to(device, non_blocking=True) for p in group_params]
        local = (
            pieces[0]
            if len(pieces) == 1
            else torch.cat(pieces, out=empty_output((sum(map(len, pieces)),), torch.uint8, device))
        )
        gathered = empty_output((local.numel() * world_size,), torch.uint8, device)  # in huge pages on the CPU
        work = dist.all_gather_into_tensor(gathered, local, group=group, async_op=True)
        rows, offset, shards = gathered.view(world_size, -1), 0, []
        for param in group_params:
            shards.append((param, rows[:, offset : offset + param.ds_tensor.numel()]))
            offset += param.ds_tensor.numel()
        groups.append((shards, work))
        sent.append(local)
    return _GatherHandle(groups, sent, tables, for_layer)
