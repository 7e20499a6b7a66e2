"""Part of a gathered frozen param decoded on its own: the values from one flat index to another of what
``codec.decode`` would return for the same gathered rows, without decoding the rest.

On the CPU only (a cast format, or the compiled kernels of ``native_codec.py``): ``zero/compute/coded_linear.py``
decodes a layer's weight a few rows at a time, each right before its matmul, so that the decoded values are read from
cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_frozen.errors import InvalidArgumentValueError
from lightning_frozen.format import native_codec
from lightning_frozen.format.codec import BlockFormat, block_format, split


def decode_range(stored: torch.Tensor, numel: int, frozen_dtype: str, start: int, out: torch.Tensor) -> torch.Tensor:
    """Decode ``out.numel()`` values from flat index ``start`` of what ``codec.decode`` would return for the same
    ``stored`` and ``numel`` (one encoded shard of ``numel`` values a row), into ``out``.

    Raises:
        InvalidArgumentValueError: ``out`` is not a contiguous tensor on the CPU, or the range runs past the end.
    """
    fmt = block_format(frozen_dtype)
    rows = stored.reshape(-1, stored.shape[-1])
    count = out.numel()
    if out.device.type != "cpu" or not out.is_contiguous() or start < 0 or start + count > rows.shape[0] * numel:
        raise InvalidArgumentValueError(
            f"`out` must be a contiguous CPU tensor within the {rows.shape[0] * numel} values, got {out.device}"
            f" values {start}..{start + count}"
        )
    flat = out.view(-1)
    if fmt.cast_dtype is None and (native_codec.kernels() is None or out.dtype not in native_codec.OUT_DTYPES):
        raise InvalidArgumentValueError(f"decoding part of a {fmt.name} tensor needs the compiled kernels")
    done = 0
    while done < count:
        row, first = divmod(start + done, numel)
        take = min(count - done, numel - first)
        piece = flat[done : done + take]
        if fmt.cast_dtype is not None:
            piece.copy_(rows[row].view(fmt.cast_dtype)[first : first + take])
        else:
            _decode_native_range(rows[row], numel, fmt, first, piece)
        done += take
    return out


def range_decoder(stored: torch.Tensor, numel: int, frozen_dtype: str) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """:func:`decode_range` for ``stored``, ``numel`` and ``frozen_dtype`` as a function of ``start`` and ``out``, for
    the many ranges decoded from one gather (a layer's tiles): with the compiled kernels a range that starts on a block
    and stays in one shard is one kernel call, the codes split once here; any other range as :func:`decode_range`."""
    fmt = block_format(frozen_dtype)
    fast = native_codec.range_decoder(stored.reshape(-1, stored.shape[-1]), numel, fmt)

    def decode(start: int, out: torch.Tensor) -> torch.Tensor:
        if fast is not None and out.device.type == "cpu" and start >= 0 and fast(start, out):
            return out
        return decode_range(stored, numel, frozen_dtype, start, out)

    return decode


def _decode_native_range(stored: torch.Tensor, numel: int, fmt: BlockFormat, first: int, out: torch.Tensor) -> None:
    """Values ``first`` to ``first + out.numel()`` of one encoded shard of ``numel`` values, into ``out``: whole blocks
    straight into it, a partial block at either end through a one-block buffer."""
    codes, scales = split(stored, fmt.name)
    size, last = fmt.block_size, first + out.numel()
    whole_first = -(-first // size)
    whole_last = max(whole_first, last // size)  # blocks whole_first..whole_last-1 lie wholly inside the range
    for block in {first // size, (last - 1) // size}:
        if whole_first <= block < whole_last:
            continue
        buffer = torch.empty(size, dtype=out.dtype)
        native_codec.decode_blocks(
            codes[block * fmt.code_bytes_per_block :], scales[block:], min(size, numel - block * size), fmt, buffer
        )
        low, high = max(first, block * size), min(last, (block + 1) * size)
        out[low - first : high - first] = buffer[low - block * size : high - block * size]
    if whole_last > whole_first:
        offset = whole_first * size - first
        span = min(whole_last * size, numel) - whole_first * size
        native_codec.decode_blocks(
            codes[whole_first * fmt.code_bytes_per_block :],
            scales[whole_first:],
            span,
            fmt,
            out[offset : offset + span],
        )
