"""Frozen ZeRO-3 shards stored below the compute dtype: block-wise int8 and 4-bit NormalFloat (NF4).

Each rank's shard of a frozen param is quantized in blocks, each block with its own scale, and stored as one
``uint8`` tensor (the codes, then the scales' bytes) in place of the bf16 shard. Gathering a quantized param
all-gathers those bytes (what crosses PCIe or the network) and dequantizes them, on the device that computes, to
the compute dtype; releasing it frees the full tensor as for any ZeRO-3 param. Trainable params are never touched.

- ``int8``: symmetric absmax, 256 weights per block, an fp32 scale each: 1.016 bytes per weight (0.51x bf16);
  a weight's error is at most ``absmax / 254`` of its block.
- ``nf4``: QLoRA's 16 NormalFloat code values (exact zero included), 64 weights per block, two codes per byte and
  an fp16 scale each (the block's absmax rounded up, so no weight leaves [-1, 1]): 0.531 bytes per weight (0.27x
  bf16; an fp32 scale would be 0.28125x). Error at most half the largest gap between code values times the scale.

Route: DeepSpeed's ZeRO-3 machinery (partitioning, the coordinator's prefetch/fetch/release hooks, ``partition``)
is kept; what is ours is the storage and the gather. DeepSpeed's ZeRO++ ``zero_quantized_nontrainable_weights``
path was not reused: its quantizer is a CUDA op that moves every shard to the GPU, and its gather paths size their
buffers at one byte per element (no 4-bit packing) and dequantize a concatenation of params with one group size.
Instead every quantized param carries ``ds_tensor.ds_quant_scale``, which makes the coordinator route it to its
quantized gather, and its own ``all_gather_coalesced`` / ``all_gather`` / ``partition`` (DeepSpeed attaches these
per param), which gather and decode the bytes described here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen import base
from lightning_frozen.errors import FrozenDtypeError
from lightning_frozen.zero import compute_dtype

FROZEN_DTYPES = ("int8", "nf4")

# QLoRA's NF4 code values (Dettmers et al. 2023, as bitsandbytes ships them): quantiles of N(0, 1) scaled to [-1, 1]
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_FP16_MAX = 65504.0
_CHUNK_ELEMENTS = 1 << 20  # weights encoded or decoded at a time: a multiple of every block size


@dataclass(frozen=True)
class BlockFormat:
    """How one frozen dtype lays out a shard: ``block_size`` weights per block, codes then one scale per block."""

    name: str
    block_size: int
    codes_per_byte: int
    scale_dtype: torch.dtype

    @property
    def code_bytes_per_block(self) -> int:
        return self.block_size // self.codes_per_byte

    @property
    def scale_bytes(self) -> int:
        return torch.empty(0, dtype=self.scale_dtype).element_size()

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def stored_bytes(self, numel: int) -> int:
        """Bytes that ``numel`` weights take: codes and scales, the last block padded."""
        return self.blocks(numel) * (self.code_bytes_per_block + self.scale_bytes)

    def describe(self) -> dict[str, Any]:
        """Plain-typed record of the format, as checkpoints store it under ``frozen_base["quantization"]``."""
        entry: dict[str, Any] = {
            "dtype": self.name,
            "block_size": self.block_size,
            "scale_dtype": str(self.scale_dtype).replace("torch.", ""),
            "bytes_per_weight": self.stored_bytes(self.block_size) / self.block_size,
        }
        if self.name == "nf4":
            entry["code_values"] = list(NF4_VALUES)
            entry["scale"] = "block absmax rounded up to fp16"
        else:
            entry["scale"] = "block absmax (fp32); code = round(127 * weight / scale)"
        return entry


FORMATS = {
    "int8": BlockFormat("int8", block_size=256, codes_per_byte=1, scale_dtype=torch.float32),
    "nf4": BlockFormat("nf4", block_size=64, codes_per_byte=2, scale_dtype=torch.float16),
}


def block_format(frozen_dtype: str) -> BlockFormat:
    """The :class:`BlockFormat` of ``frozen_dtype``.

    Raises:
        FrozenDtypeError: ``frozen_dtype`` is not ``"int8"`` or ``"nf4"``.
    """
    check_frozen_dtype(frozen_dtype)
    return FORMATS[frozen_dtype]


def check_frozen_dtype(frozen_dtype: Any) -> None:
    """Raise :class:`FrozenDtypeError` unless ``frozen_dtype`` is None, ``"int8"`` or ``"nf4"``."""
    if frozen_dtype is not None and frozen_dtype not in FROZEN_DTYPES:
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` is not a frozen storage dtype: pass `'int8'` (block-wise absmax, 1.016"
            " bytes per weight), `'nf4'` (4-bit NormalFloat, 0.531 bytes per weight) or None (the compute dtype)."
        )


def storage_bytes(numel: int, frozen_dtype: Optional[str], compute_bytes: int) -> int:
    """Bytes that ``numel`` frozen weights take in ``frozen_dtype`` (``compute_bytes`` each when None)."""
    if frozen_dtype is None:
        return numel * compute_bytes
    return block_format(frozen_dtype).stored_bytes(numel)


# ---------------------------------------------------------------------------------------------- encode / decode


def _nf4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)


def _nf4_pairs(device: torch.device) -> torch.Tensor:
    """The two code values of every byte, low nibble first: a (256, 2) table."""
    table = _nf4_table(device)
    byte = torch.arange(256, device=device)
    return torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=1)


def _scale_up_to_fp16(absmax: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= ``absmax``, per block, so every weight divided by it stays in [-1, 1]."""
    scale = absmax.to(torch.float16)
    low = scale.float() < absmax
    return torch.where(low, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)


def encode(values: torch.Tensor, frozen_dtype: str, numel: Optional[int] = None) -> torch.Tensor:
    """Quantize a 1-D tensor block-wise; returns one ``uint8`` tensor: the codes, then the scales' bytes.

    The values are padded with zeros to ``numel`` (default: their own count), then to whole blocks. Works through
    the tensor in chunks, so the fp32 temporaries stay small whatever its size. Deterministic: the same values give
    the same bytes on any device.

    Raises:
        FrozenDtypeError: an unknown ``frozen_dtype``, or (``nf4``) a block whose absmax exceeds fp16's range.
    """
    fmt = block_format(frozen_dtype)
    flat = values.detach().reshape(-1)
    blocks = fmt.blocks(max(flat.numel(), numel or 0))
    code_bytes = blocks * fmt.code_bytes_per_block
    stored = torch.empty(code_bytes + blocks * fmt.scale_bytes, dtype=torch.uint8, device=flat.device)
    codes, scales = stored[:code_bytes], stored[code_bytes:].view(fmt.scale_dtype)
    per_chunk = _CHUNK_ELEMENTS // fmt.block_size
    for first in range(0, blocks, per_chunk):
        last = min(first + per_chunk, blocks)
        chunk = flat[first * fmt.block_size : last * fmt.block_size].float()
        if chunk.numel() < (last - first) * fmt.block_size:
            chunk = torch.nn.functional.pad(chunk, (0, (last - first) * fmt.block_size - chunk.numel()))
        chunk_codes, chunk_scales = _encode_blocks(chunk.view(-1, fmt.block_size), fmt)
        codes[first * fmt.code_bytes_per_block : last * fmt.code_bytes_per_block] = chunk_codes.reshape(-1)
        scales[first:last] = chunk_scales
    return stored


def _encode_blocks(blocks: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``uint8``, packed for NF4) and scales (``fmt.scale_dtype``) of fp32 ``blocks`` (one block a row)."""
    absmax = blocks.abs().amax(dim=1)
    if fmt.name == "int8":
        inverse = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
        codes = torch.round(blocks * inverse[:, None]).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        return codes, absmax
    if bool((absmax > _FP16_MAX).any()):
        raise FrozenDtypeError(
            f"A block of this tensor holds a weight of magnitude {float(absmax.max()):.3g}, beyond the fp16 range"
            " of NF4's block scales. Store this base with `frozen_dtype='int8'` (fp32 scales)."
        )
    scale = _scale_up_to_fp16(absmax)
    wide = scale.float()
    normalized = blocks / torch.where(wide > 0, wide, torch.ones_like(wide))[:, None]
    table = _nf4_table(blocks.device)
    index = torch.bucketize(normalized, (table[1:] + table[:-1]) / 2, out_int32=True).to(torch.uint8).view(-1, 2)
    return index[:, 0] | (index[:, 1] << 4), scale


def split(stored: torch.Tensor, frozen_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``uint8`` codes and the per-block scales (in the format's scale dtype) of stored bytes (1-D or rows)."""
    fmt = block_format(frozen_dtype)
    per_block = fmt.code_bytes_per_block + fmt.scale_bytes
    blocks = stored.shape[-1] // per_block
    code_bytes = blocks * fmt.code_bytes_per_block
    codes = stored[..., :code_bytes]
    scales = stored[..., code_bytes:].contiguous().view(fmt.scale_dtype)
    return codes, scales


def decode(stored: torch.Tensor, numel: int, frozen_dtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize what :func:`encode` returned: the first ``numel`` values, in ``dtype``.

    ``stored`` may also be a 2-D tensor, one encoded shard per row (what an all-gather returns); then each row's
    first ``numel`` values are kept and the rows concatenated. Works in chunks: besides the result, only small
    fp32 temporaries are allocated.
    """
    fmt = block_format(frozen_dtype)
    rows = stored.reshape(-1, stored.shape[-1])
    codes, scales = split(rows, frozen_dtype)
    out = torch.empty(rows.shape[0], numel, dtype=dtype, device=stored.device)
    per_chunk = _CHUNK_ELEMENTS // fmt.block_size
    pairs = _nf4_pairs(stored.device) if fmt.name == "nf4" else None
    for row in range(rows.shape[0]):
        for first in range(0, math.ceil(numel / fmt.block_size), per_chunk):
            last = min(first + per_chunk, scales.shape[-1])
            chunk = codes[row, first * fmt.code_bytes_per_block : last * fmt.code_bytes_per_block]
            if pairs is None:
                values = chunk.view(torch.int8).float().view(-1, fmt.block_size)
                values = values * (scales[row, first:last].float() / 127.0)[:, None]
            else:  # one lookup per byte gives both of its code values
                values = pairs[chunk.int()].view(-1, fmt.block_size) * scales[row, first:last].float()[:, None]
            start = first * fmt.block_size
            stop = min(last * fmt.block_size, numel)
            out[row, start:stop] = values.view(-1)[: stop - start]
    return out.view(-1)


# ---------------------------------------------------------------------------------------------- ZeRO-3 shards

_FROZEN_DTYPE_ATTR = "lf_frozen_dtype"


def frozen_dtype_of(param: nn.Parameter) -> Optional[str]:
    """``"int8"``/``"nf4"`` when ``param``'s ZeRO-3 shard is stored quantized, else None."""
    return getattr(param, _FROZEN_DTYPE_ATTR, None)


def quantized_shard_bytes(params: Iterable[nn.Parameter]) -> int:
    """Bytes this rank holds of the quantized shards among ``params`` (codes and scales)."""
    return sum(p.ds_tensor.numel() for p in params if frozen_dtype_of(p) is not None)


def check_config(frozen_dtype: str, config: dict, device: torch.device) -> None:
    """Check that ``frozen_dtype`` fits the DeepSpeed ``config`` and runs on ``device`` in the compute dtype.

    Raises:
        FrozenDtypeError: ZeRO stage 3 is off, DeepSpeed's own ``zero_quantized_nontrainable_weights`` is on too,
            params are offloaded to NVMe, or the accelerator cannot run the dequantization.
    """
    zero_config = config.get("zero_optimization") or {}
    if zero_config.get("stage") != 3:
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` stores ZeRO-3 shards, but ZeRO stage {zero_config.get('stage')} is"
            " configured. Use `stage=3` (the default of `frozen_deepspeed`)."
        )
    if zero_config.get("zero_quantized_nontrainable_weights") or zero_config.get("zero_quantized_weights"):
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` and DeepSpeed's `zero_quantized_(nontrainable_)weights` both quantize"
            " the frozen shards. Remove the DeepSpeed option from the config."
        )
    if ((zero_config.get("offload_param") or {}).get("device")) == "nvme":
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` keeps shards in host or device memory; DeepSpeed's NVMe parameter"
            " offload swaps them as compute-dtype tensors. Remove `offload_param: {device: nvme}` or the frozen_dtype."
        )
    check_runs_on(frozen_dtype, device, compute_dtype(config) or torch.float32)


def check_runs_on(frozen_dtype: str, device: torch.device, dtype: torch.dtype) -> None:
    """Quantize and dequantize one block on ``device`` in ``dtype``, as training will.

    Raises:
        FrozenDtypeError: the accelerator cannot run it; the message names the device and the fix.
    """
    fmt = block_format(frozen_dtype)
    try:
        sample = torch.linspace(-1, 1, fmt.block_size, device=device)
        decode(encode(sample, frozen_dtype), fmt.block_size, frozen_dtype, dtype)
    except (RuntimeError, AssertionError, TypeError) as error:
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` cannot dequantize to {dtype} on `{device}`"
            f" ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Train on an accelerator"
            " that runs it, or pass `frozen_dtype=None`."
        ) from error


def quantize_frozen_shards(model: nn.Module, frozen_dtype: str, fingerprint_mode: str = "checksum") -> int:
    """Store every frozen ZeRO-3 param's shard of ``model`` quantized in ``frozen_dtype``; return how many it did.

    Each shard is quantized in turn, on the device it lives on, and its compute-dtype copy freed: no full copy of
    the base beyond what partitioning made. The fingerprint of the source values (``fingerprint_mode``) is kept
    on the param first, so checkpoints verify against the unquantized base. Params quantized before are skipped.
    Collective for ``fingerprint_mode="sha256"``.

    Raises:
        FrozenDtypeError: a quantized param was made trainable (its source values are gone), or a frozen param is
            not a ZeRO-3 param or not released.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

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
            continue
        if not hasattr(param, "ds_id") or param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise FrozenDtypeError(
                f"`{name}` is frozen but not a released ZeRO-3 shard, so it cannot be stored as {fmt.name}."
                " `frozen_dtype` needs ZeRO stage 3 (`stage=3`, the default)."
            )
        quantize_param_shard(param, fmt.name, fingerprint_mode)
        done += 1
    return done


def quantize_param_shard(param: nn.Parameter, frozen_dtype: str, fingerprint_mode: str = "checksum") -> None:
    """Quantize one released ZeRO-3 param's shard (see :func:`quantize_frozen_shards`).

    Raises:
        FrozenDtypeError: ``param`` requires grad: trainable params keep their compute dtype.
    """
    if param.requires_grad:
        raise FrozenDtypeError(
            f"A trainable param (shape {tuple(getattr(param, 'ds_shape', param.shape))}) cannot be stored as"
            f" {frozen_dtype}: only frozen params (`requires_grad=False`) are quantized. Freeze it first"
            " (`requires_grad_(False)`) or leave it out of the frozen base."
        )
    fmt = block_format(frozen_dtype)
    setattr(param, base.SOURCE_CHECKSUM, base.shard_checksum(param))
    if fingerprint_mode == "sha256":
        setattr(param, base.SOURCE_SHA256, base.param_sha256(param))
    values, _ = base.local_values(param)
    _store(param, encode(values, fmt.name, numel=int(param.ds_tensor.ds_numel)), fmt)
    _install_gather(param)


def _store(param: nn.Parameter, stored: torch.Tensor, fmt: BlockFormat) -> None:
    """Put the encoded bytes in place of the shard; ``ds_quant_scale`` routes the param to the quantized gather."""
    from deepspeed.accelerator import get_accelerator

    shard = param.ds_tensor
    if shard.device.type == "cpu" and shard.is_pinned():
        stored = get_accelerator().pin_memory(stored)
    shard.data = stored
    shard.ds_quant_scale = split(stored, fmt.name)[1]
    setattr(param, _FROZEN_DTYPE_ATTR, fmt.name)


def _install_gather(param: nn.Parameter) -> None:
    original_partition = param.partition

    def all_gather_coalesced(params: Iterable[nn.Parameter], safe_mode: bool = False, quantize: bool = False) -> Any:
        params = list(params)
        others = [p for p in params if frozen_dtype_of(p) is None]
        handles = [_gather([p for p in params if frozen_dtype_of(p) is not None])]
        if others:
            handles.append(others[0].all_gather_coalesced(others, safe_mode=safe_mode, quantize=quantize))
        return _Handles(handles)

    def all_gather(param_list: Optional[list] = None, async_op: bool = False, hierarchy: int = 0) -> Any:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        param_list = [param] if param_list is None else list(param_list)
        ours = [
            p for p in param_list if frozen_dtype_of(p) is not None and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
        ]
        others = [p for p in param_list if frozen_dtype_of(p) is None]
        _gather(ours).wait()
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
                _requantize_from_full(p)
        if ours:
            original_partition(param_list=ours, hierarchy=hierarchy, has_been_updated=False, free_data=free_data)
        if others:
            others[0].partition(
                param_list=others, hierarchy=hierarchy, has_been_updated=has_been_updated, free_data=free_data
            )

    param.all_gather_coalesced = all_gather_coalesced
    param.all_gather = all_gather
    param.partition = partition


def _requantize_from_full(param: nn.Parameter) -> None:
    import deepspeed.comm as dist

    frozen_dtype = frozen_dtype_of(param)
    assert frozen_dtype is not None
    shard_numel = int(param.ds_tensor.ds_numel)
    start = shard_numel * dist.get_rank(group=param.ds_process_group)
    piece = param.data.detach().reshape(-1)[start : start + shard_numel].to(param.ds_tensor.device)
    setattr(param, base.SOURCE_CHECKSUM, base.values_checksum(piece, start))
    _store(param, encode(piece, frozen_dtype, numel=shard_numel), FORMATS[frozen_dtype])


class _Handles:
    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


class _DoneHandle:
    """The gather already happened; ``wait`` marks the params available, as DeepSpeed's handles do, once.

    DeepSpeed's coordinator keeps one handle per prefetched param and waits on it when that param is needed: a
    handle shared by several params is waited on again after some of them were released, which must not mark those
    available again (their data is freed)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.complete = False

    def wait(self, handle_dependency: bool = True) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if self.complete:
            return
        for param in self.params:
            param.ds_status = ZeroParamStatus.AVAILABLE
        self.complete = True


def _gather(params: list[nn.Parameter]) -> _DoneHandle:
    """All-gather the encoded shards of ``params`` (one collective per process group) and decode each param whole,
    in its compute dtype, on the accelerator. Every rank passes the same params (sorted here by ``ds_id``)."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    device = torch.device(get_accelerator().current_device_name())
    by_group: dict[int, list[nn.Parameter]] = {}
    for param in sorted(params, key=lambda p: p.ds_id):
        # DeepSpeed's own gather asserts the same: only released params are fetched
        assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE, f"expected a released param, got {param.ds_summary()}"
        param.ds_status = ZeroParamStatus.INFLIGHT
        by_group.setdefault(id(param.ds_process_group), []).append(param)
    for group_params in by_group.values():
        group = group_params[0].ds_process_group
        world_size = dist.get_world_size(group=group)
        local = torch.cat([p.ds_tensor.data.to(device, non_blocking=True) for p in group_params])
        if world_size > 1:
            gathered = torch.empty(local.numel() * world_size, dtype=torch.uint8, device=device)
            dist.all_gather_into_tensor(gathered, local, group=group)
        else:
            gathered = local
        rows = gathered.view(world_size, -1)
        offset = 0
        for param in group_params:
            size = param.ds_tensor.numel()
            frozen_dtype = frozen_dtype_of(param)
            assert frozen_dtype is not None
            values = decode(rows[:, offset : offset + size], int(param.ds_tensor.ds_numel), frozen_dtype, param.dtype)
            param.data = values[: param.ds_numel].view(param.ds_shape)
            offset += size
    return _DoneHandle(params)
