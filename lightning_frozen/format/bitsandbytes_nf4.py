"""bitsandbytes' NF4 dequantization kernel, for shards on CUDA (its CPU kernel is slower than ``codec_kernels.c``).

Our NF4 layout is bitsandbytes' packed layout (64 weights a block, the first of each byte's two weights in the high
nibble, the same 16 code values), except that the scales are fp16 (rounded up) where bitsandbytes keeps fp32: they are
widened exactly before the call. Written against bitsandbytes 0.50's public ``functional.dequantize_4bit``
(``absmax=``, ``out=``, ``blocksize=``, ``quant_type=``); where bitsandbytes is missing, older, or gives other code
values, :func:`usable` is False and the codec uses tensor ops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_frozen.errors import FrozenDtypeError


@functools.cache
def _functional() -> Optional[Any]:
    try:
        import bitsandbytes.functional as functional
    except Exception:  # not installed, or its native library does not load here
        return None
    return functional if hasattr(functional, "dequantize_4bit") else None


@functools.cache
def _same_code_values(values: tuple[float, ...]) -> bool:
    functional = _functional()
    code = getattr(functional, "get_4bit_type", None)
    if code is None:
        return False
    return bool(torch.equal(code("nf4", device="cpu").float(), torch.tensor(values, dtype=torch.float32)))


def usable(device: torch.device) -> bool:
    """Whether bitsandbytes can decode NF4 on ``device`` (a CUDA device; CPU shards use the package's kernels)."""
    return device.type == "cuda" and _functional() is not None


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, numel: int, values: Sequence[float], out: torch.Tensor
) -> None:
    """Decode the first ``numel`` weights of packed NF4 ``codes`` with fp16 block ``scales`` into ``out``.

    Raises:
        FrozenDtypeError: bitsandbytes' NF4 code values are not ``values`` (a bitsandbytes that changed them).
    """
    if not _same_code_values(tuple(values)):
        raise FrozenDtypeError(
            "bitsandbytes' NF4 code values differ from the ones these frozen shards were encoded with: install"
            " bitsandbytes 0.50 (`pip install 'lightning-frozen[bitsandbytes]'`)."
        )
    functional = _functional()
    packed = codes[: (numel + 1) // 2].contiguous()
    state = functional.QuantState(
        absmax=scales.float(), shape=out.shape, dtype=out.dtype, blocksize=64, quant_type="nf4"
    )
    if out.device.type == "cuda":
        functional.dequantize_4bit(packed, state, out=out)
    else:  # its CPU backend has no `out=` variant (used by the tests, which compare layouts on the CPU)
        out.copy_(functional.dequantize_4bit(packed, state).view(out.shape))
