"""Frozen weights stored below the compute dtype, encoded into and decoded from one ``uint8`` tensor (the codes, then
the scales' bytes): block-wise int8 absmax and 4-bit NormalFloat (NF4), and plain bf16/fp16 casts. Plain tensor
functions; ``zero/frozen_storage.py`` stores ZeRO-3 shards with them. Every format is one row of ``FORMATS``. They run
the :class:`Kernels` a caller hands in (the CPU's compiled ones, ``native_codec.py``, through
``zero/frozen_compute.py``), NF4 on CUDA bitsandbytes' kernel (``bitsandbytes_nf4.py``), else tensor ops; all give the
same codes and values.

- ``int8``: symmetric absmax, 256 weights per block, an fp32 scale each: 1.016 bytes per weight (0.51x bf16);
  a weight's error is at most ``absmax / 254`` of its block.
- ``nf4``: QLoRA's 16 NormalFloat code values (exact zero included), 64 weights per block, two codes per byte (the
  first weight in the high nibble, as bitsandbytes packs them, so its CUDA kernel reads the codes as they are) and
  an fp16 scale each (the block's absmax rounded up, so no weight leaves [-1, 1]): 0.531 bytes per weight (0.27x
  bf16; an fp32 scale would be 0.28125x). Error at most half the largest gap between code values times the scale.
- ``bf16`` / ``fp16``: each weight cast to that dtype (round to nearest even), no scale: 2 bytes per weight, decoded
  by a cast to the compute dtype. For fp32 compute over a base half the size of fp32 (CPUs without fast bf16
  matmuls).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from lightning_frozen.errors import FrozenDtypeError, InvalidArgumentValueError
from lightning_frozen.format import bitsandbytes_nf4, layout

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
NF4_PACKING = "high nibble first"
_FP16_MAX = 65504.0
_INT8_STEPS = torch.tensor(127.0)  # the int8 code of a block's absmax
_CHUNK_ELEMENTS = 1 << 20  # weights encoded or decoded at a time: a multiple of every block size


@dataclass(frozen=True)
class BlockFormat:
    """How one frozen dtype lays out a shard: ``block_size`` weights per block, codes then one scale per block.

    A cast format (``cast_dtype`` set) has no scale: each code is the weight in ``cast_dtype``."""

    name: str
    block_size: int
    code_bits: int
    scale_dtype: Optional[torch.dtype]
    cast_dtype: Optional[torch.dtype] = None
    bytes_note: str = ""  # what the error message offering the formats says of it

    @property
    def code_bytes_per_block(self) -> int:
        return self.block_size * self.code_bits // 8

    @property
    def scale_bytes(self) -> int:
        return 0 if self.scale_dtype is None else torch.empty(0, dtype=self.scale_dtype).element_size()

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def stored_bytes(self, numel: int) -> int:
        """Bytes that ``numel`` weights take: codes and scales, the last block padded."""
        return self.blocks(numel) * (self.code_bytes_per_block + self.scale_bytes)

    def describe(self) -> dict[str, Any]:
        """Plain-typed record of the format, as checkpoints store it (the ``frozen_base`` entry's ``quantization``)."""
        entry: dict[str, Any] = {
            layout.DTYPE: self.name,
            layout.BLOCK_SIZE: self.block_size,
            layout.SCALE_DTYPE: None if self.scale_dtype is None else str(self.scale_dtype).replace("torch.", ""),
            layout.BYTES_PER_WEIGHT: self.stored_bytes(self.block_size) / self.block_size,
        }
        if self.name == "nf4":
            entry[layout.CODE_VALUES] = list(NF4_VALUES)
            entry[layout.SCALE] = "block absmax rounded up to fp16"
            entry[layout.PACKING] = NF4_PACKING
        elif self.cast_dtype is not None:
            entry[layout.SCALE] = f"none; code = weight cast to {self.name}"
        else:
            entry[layout.SCALE] = "block absmax (fp32); code = round(127 * weight / scale)"
        return entry


FORMATS = {
    "int8": BlockFormat("int8", 256, code_bits=8, scale_dtype=torch.float32, bytes_note="block-wise absmax, 1.016"),
    "nf4": BlockFormat("nf4", 64, code_bits=4, scale_dtype=torch.float16, bytes_note="4-bit NormalFloat, 0.531"),
    "bf16": BlockFormat("bf16", 1, 16, None, cast_dtype=torch.bfloat16, bytes_note="a cast, 2"),
    "fp16": BlockFormat("fp16", 1, 16, None, cast_dtype=torch.float16, bytes_note="a cast, 2"),
}
FROZEN_DTYPES = tuple(FORMATS)


def block_format(frozen_dtype: str) -> BlockFormat:
    """The :class:`BlockFormat` of ``frozen_dtype``.

    Raises:
        FrozenDtypeError: ``frozen_dtype`` is not one of ``FROZEN_DTYPES``.
    """
    check_frozen_dtype(frozen_dtype)
    return FORMATS[frozen_dtype]


def check_frozen_dtype(frozen_dtype: Any) -> None:
    """Raise :class:`FrozenDtypeError` unless ``frozen_dtype`` is None or one of ``FROZEN_DTYPES``."""
    if frozen_dtype is not None and frozen_dtype not in FROZEN_DTYPES:
        offered = ", ".join(f"`{fmt.name!r}` ({fmt.bytes_note} bytes per weight)" for fmt in FORMATS.values())
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` is not a frozen storage dtype: pass {offered} or None (the compute"
            " dtype)."
        )


def storage_bytes(numel: int, frozen_dtype: Optional[str], compute_bytes: int) -> int:
    """Bytes that ``numel`` frozen weights take in ``frozen_dtype`` (``compute_bytes`` each when None)."""
    if frozen_dtype is None:
        return numel * compute_bytes
    return block_format(frozen_dtype).stored_bytes(numel)


# ---------------------------------------------------------------------------------------------- encode / decode


class Kernels(Protocol):
    """Compiled passes the codec runs where they take the tensors at hand, each giving the tensor ops' codes and values
    to the bit: ``encode`` returns None where it cannot, else 0 or the 1-based index of a block beyond the format's
    range; ``decode`` whether it did. ``checksum`` is the fingerprint's (``base/fingerprint.py``)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...
    def encode(
        self, flat: torch.Tensor, fmt: BlockFormat, codes: torch.Tensor, scales: torch.Tensor
    ) -> Optional[int]: ...
    def decode(
        self, codes: torch.Tensor, scales: torch.Tensor, numel: int, fmt: BlockFormat, out: torch.Tensor
    ) -> bool: ...
    def checksum(self, values: torch.Tensor, start: int) -> Optional[list[int]]: ...


def nf4_table(device: torch.device) -> torch.Tensor:
    """QLoRA's 16 code values (fp32), in code order."""
    return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)


def _nf4_pairs(device: torch.device) -> torch.Tensor:
    """The two code values of every byte, high nibble first: a (256, 2) table."""
    table = nf4_table(device)
    byte = torch.arange(256, device=device)
    return torch.stack([table[byte >> 4], table[byte & 0x0F]], dim=1)


def nf4_bounds(device: torch.device) -> torch.Tensor:
    """The 15 bounds between neighbouring code values (fp32): a weight takes the code of the bucket it falls in."""
    table = nf4_table(device)
    return (table[1:] + table[:-1]) / 2


def _scale_up_to_fp16(absmax: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= ``absmax``, per block, so every weight divided by it stays in [-1, 1]."""
    scale = absmax.to(torch.float16)
    low = scale.float() < absmax
    return torch.where(low, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)


def encode(
    values: torch.Tensor, frozen_dtype: str, numel: Optional[int] = None, kernels: Optional[Kernels] = None
) -> torch.Tensor:
    """Quantize a 1-D tensor block-wise; returns one ``uint8`` tensor: the codes, then the scales' bytes.

    The values are padded with zeros to ``numel`` (default: their own count), then to whole blocks. ``kernels`` (one
    pass) and tensor ops (in chunks) give the same bytes on any device.

    Raises:
        FrozenDtypeError: an unknown ``frozen_dtype``, or (``nf4``) a block whose absmax exceeds fp16's range.
    """
    fmt = block_format(frozen_dtype)
    flat = values.detach().reshape(-1)
    blocks = fmt.blocks(max(flat.numel(), numel or 0))
    empty = torch.empty if kernels is None else kernels.empty
    if fmt.cast_dtype is not None:
        return _encode_cast(flat, blocks, fmt, empty)
    code_bytes = blocks * fmt.code_bytes_per_block
    stored = empty((code_bytes + blocks * fmt.scale_bytes,), dtype=torch.uint8, device=flat.device)
    codes, scales = stored[:code_bytes], stored[code_bytes:].view(fmt.scale_dtype)
    if kernels is not None and _encoded(kernels, flat, fmt, codes, scales):
        return stored
    per_chunk = _CHUNK_ELEMENTS // fmt.block_size
    for first in range(0, blocks, per_chunk):
        last = min(first + per_chunk, blocks)
        chunk = flat[first * fmt.block_size : last * fmt.block_size].float()
        chunk_codes = codes[first * fmt.code_bytes_per_block : last * fmt.code_bytes_per_block]
        if kernels is not None and _encoded(kernels, chunk, fmt, chunk_codes, scales[first:last]):
            continue
        if chunk.numel() < (last - first) * fmt.block_size:
            chunk = torch.nn.functional.pad(chunk, (0, (last - first) * fmt.block_size - chunk.numel()))
        block_codes, scales[first:last] = _encode_blocks(chunk.view(-1, fmt.block_size), fmt)
        chunk_codes.copy_(block_codes.reshape(-1))
    return stored


def _encoded(kernels: Kernels, flat: torch.Tensor, fmt: BlockFormat, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``kernels`` encoded ``flat`` into ``codes`` and ``scales``; raises at a block beyond NF4's range."""
    status = kernels.encode(flat, fmt, codes, scales)
    if status:
        _beyond_fp16(float(flat[(status - 1) * fmt.block_size : status * fmt.block_size].float().abs().max()))
    return status is not None


def _beyond_fp16(magnitude: float) -> None:
    raise FrozenDtypeError(
        f"A block of this tensor holds a weight of magnitude {magnitude:.3g}, beyond the fp16 range of NF4's block"
        " scales. Store this base with `frozen_dtype='int8'` (fp32 scales)."
    )


def _encode_cast(flat: torch.Tensor, blocks: int, fmt: BlockFormat, empty: Callable[..., torch.Tensor]) -> torch.Tensor:
    if fmt.cast_dtype == torch.float16 and flat.numel():
        low, high = torch.aminmax(flat)  # no full-size temporary, unlike abs()
        if max(-float(low), float(high)) > _FP16_MAX:
            raise FrozenDtypeError(
                f"This tensor holds a weight of magnitude {max(-float(low), float(high)):.3g}, beyond fp16's"
                " range. Store this base with `frozen_dtype='bf16'`."
            )
    cast = empty((blocks,), dtype=fmt.cast_dtype, device=flat.device)
    cast[: flat.numel()] = flat  # one pass: no zeros written first
    cast[flat.numel() :].zero_()
    return cast.view(torch.uint8)


def _encode_blocks(blocks: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``uint8``, packed for NF4) and scales (``fmt.scale_dtype``) of fp32 ``blocks`` (one block a row)."""
    absmax = blocks.abs().amax(dim=1)
    if fmt.name == "int8":
        inverse = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
        codes = torch.round(blocks * inverse[:, None]).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        return codes, absmax
    if bool((absmax > _FP16_MAX).any()):
        _beyond_fp16(float(absmax.max()))
    scale = _scale_up_to_fp16(absmax)
    wide = scale.float()
    normalized = blocks / torch.where(wide > 0, wide, torch.ones_like(wide))[:, None]
    index = torch.bucketize(normalized, nf4_bounds(blocks.device), out_int32=True).to(torch.uint8).view(-1, 2)
    return (index[:, 0] << 4) | index[:, 1], scale


def split(stored: torch.Tensor, frozen_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``uint8`` codes and the per-block scales (in the format's scale dtype) of stored bytes (1-D or rows)."""
    fmt = block_format(frozen_dtype)
    per_block = fmt.code_bytes_per_block + fmt.scale_bytes
    blocks = stored.shape[-1] // per_block
    code_bytes = blocks * fmt.code_bytes_per_block
    codes = stored[..., :code_bytes]
    if fmt.scale_dtype is None:
        return codes, stored[..., code_bytes:]  # a cast format: no scales, an empty tensor
    scales = stored[..., code_bytes:].contiguous().view(fmt.scale_dtype)
    return codes, scales


def decode(
    stored: torch.Tensor,
    numel: int,
    frozen_dtype: str,
    dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
    kernels: Optional[Kernels] = None,
) -> torch.Tensor:
    """Dequantize what :func:`encode` returned: the first ``numel`` values, in ``dtype``.

    ``stored`` may also be a 2-D tensor, one encoded shard per row (an all-gather's); then each row's first ``numel``
    values are kept and the rows concatenated. ``out``, when given, is written instead of a new tensor (``dtype``,
    ``numel`` values per row, on ``stored``'s device).
    """
    fmt = block_format(frozen_dtype)
    rows = stored.reshape(-1, stored.shape[-1])
    shape = (rows.shape[0], numel)
    if out is not None:
        if out.numel() != rows.shape[0] * numel or out.dtype != dtype or not out.is_contiguous():
            raise InvalidArgumentValueError(
                f"`out` must be a contiguous {dtype} tensor of {rows.shape[0] * numel} values, got"
                f" {out.dtype} of {out.numel()}"
            )
        out = out.view(shape)
    else:
        out = (torch.empty if kernels is None else kernels.empty)(shape, dtype=dtype, device=stored.device)
    if fmt.cast_dtype is not None:
        for row in range(rows.shape[0]):  # a row of a gather's 2-D result is contiguous on its own
            out[row] = rows[row].view(fmt.cast_dtype)[:numel]
        return out.view(-1)
    for row in range(rows.shape[0]):
        codes, scales = split(rows[row], frozen_dtype)
        if kernels is not None and kernels.decode(codes, scales, numel, fmt, out[row]):
            continue
        if fmt.name == "nf4" and bitsandbytes_nf4.usable(stored.device):
            bitsandbytes_nf4.dequantize(codes, scales, numel, NF4_VALUES, out[row])
        else:
            _decode_chunks(codes, scales, numel, fmt, out[row])
    return out.view(-1)


def _decode_chunks(codes: torch.Tensor, scales: torch.Tensor, numel: int, fmt: BlockFormat, out: torch.Tensor) -> None:
    # on CUDA a chunk is one kernel launch per op, so far larger chunks than the CPU's
    per_chunk = (_CHUNK_ELEMENTS if codes.device.type == "cpu" else 64 * _CHUNK_ELEMENTS) // fmt.block_size
    pairs = _nf4_pairs(codes.device) if fmt.name == "nf4" else None
    for first in range(0, fmt.blocks(numel), per_chunk):
        last = min(first + per_chunk, scales.shape[-1])
        chunk = codes[first * fmt.code_bytes_per_block : last * fmt.code_bytes_per_block]
        if pairs is None:
            values = chunk.view(torch.int8).float().view(-1, fmt.block_size)
            # CUDA divides by a Python number as a multiply by its reciprocal: divide by a tensor, as the CPU does
            values = values * (scales[first:last].float() / _INT8_STEPS.to(scales.device))[:, None]
        else:  # one lookup per byte gives both of its code values
            values = pairs[chunk.int()].view(-1, fmt.block_size) * scales[first:last].float()[:, None]
        start = first * fmt.block_size
        stop = min(last * fmt.block_size, numel)
        out[start:stop] = values.view(-1)[: stop - start]
