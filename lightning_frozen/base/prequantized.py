"""Folders that bitsandbytes saved quantized (``save_pretrained`` of a ``load_in_4bit`` nf4 model, the "-bnb-4bit"
folders): each weight is ``x.weight`` (the packed codes, two a byte, high nibble first, 64 weights a block) with
``x.weight.absmax`` (a block's fp32 scale; with double quantization an 8-bit code per block, decoded with
``x.weight.nested_absmax`` per 256 blocks, ``nested_quant_map`` and an offset), ``quant_map`` (the 16 NF4 values) and
``quant_state.bitsandbytes__nf4`` (JSON: shape, block size, dtype).

:func:`packed_source` makes such a weight a ``TensorSource`` whose slice reads only the codes and scales of the blocks
it covers and gives their values as bitsandbytes dequantizes them (code value times absmax, in fp32); the loader then
stores them as it stores any slice. Encoding those values as the package's NF4 gives back the folder's codes for every
block that lies whole in the shard (its largest weight is +-absmax, so the encoder finds the same absmax; rounded up to
fp16 it moves no weight across the midpoint between two NF4 values), and the scale rounded up to fp16: each weight at
most 2^-10 of itself larger than bitsandbytes'. docs/frozen-storage.md says why not fp32 scales.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_frozen.base import slice_reads
from lightning_frozen.errors import BitsAndBytesConfigError, UnsupportedConfigurationError
from lightning_frozen.format.codec import NF4_VALUES, nf4_table
from lightning_frozen.hf import transformers_loading

QUANT_STATE = ".quant_state.bitsandbytes__"  # the key suffix of a weight's quant state, then its quant type
_BYTES_PER_BLOCK = 32  # 64 codes, two a byte


@dataclass(frozen=True)
class PackedNF4:
    """Where one weight's codes and scales lie in its safetensors file (``path``), as bitsandbytes saved them."""

    path: str
    key: str  # the packed codes, of any storage dtype (``bnb_4bit_quant_storage``)
    numel: int
    storage: slice_reads.StoredTensor
    nested: Optional[tuple[torch.Tensor, float]] = None  # the 8-bit code values of the scales and their offset
    nested_blocks: int = 256  # scales per nested scale


@dataclass(frozen=True)
class PackedNF4Source(slice_reads.TensorSource):
    """A weight bitsandbytes stored as NF4: a slice reads the codes of its blocks only, and its scales (``values``)."""

    packed: PackedNF4 = field(kw_only=True)

    def reads(self, start: int, count: int) -> list[slice_reads.SliceRead]:
        packed = self.packed
        first, last = _blocks(start, count)
        per_element = packed.storage.nbytes // packed.storage.dtype.itemsize
        item = packed.storage.dtype.itemsize
        begin, end = first * _BYTES_PER_BLOCK // item, min(per_element, -(-last * _BYTES_PER_BLOCK // item))
        return [slice_reads.SliceRead(packed.path, packed.key, begin, max(0, end - begin))]

    def values(self, read: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """The flat weights ``[start, start + count)`` as bitsandbytes dequantizes them (fp32), from ``read``, the
        codes :meth:`reads` gave; reads the blocks' scales."""
        packed = self.packed
        first, last = _blocks(start, count)
        codes = read.view(torch.uint8)[: (last - first) * _BYTES_PER_BLOCK]
        codes = torch.nn.functional.pad(codes, (0, (last - first) * _BYTES_PER_BLOCK - codes.numel()))  # a last block
        scales = _scales(packed, first, last)
        pairs = nf4_table(codes.device)[torch.stack([codes >> 4, codes & 0x0F], dim=1).long()].view(-1, 64)
        values = (pairs * scales[: pairs.shape[0], None]).view(-1)
        return values[start - first * 64 : start - first * 64 + count]


def _blocks(start: int, count: int) -> tuple[int, int]:
    return start // 64, -(-(start + count) // 64)


def _scales(packed: PackedNF4, first: int, last: int) -> torch.Tensor:
    """The fp32 absmax of blocks ``[first, last)``, as bitsandbytes computes it (its ``dequantize_blockwise`` plus the
    offset, for double quantization)."""
    absmax = slice_reads.read_slice(slice_reads.SliceRead(packed.path, f"{packed.key}.absmax", first, last - first))
    if packed.nested is None:
        return absmax.float()
    code, offset = packed.nested
    size = packed.nested_blocks
    outer = slice_reads.read_slice(
        slice_reads.SliceRead(
            packed.path, f"{packed.key}.nested_absmax", first // size, (last - 1) // size + 1 - first // size
        )
    )
    index = torch.arange(first, last) // size - first // size
    return code[absmax.long()] * outer[index] + torch.tensor(offset, dtype=torch.float32)


def packed_source(key: str, index: slice_reads.FolderIndex) -> Optional[PackedNF4Source]:
    """The source of the folder tensor ``key`` of ``index`` where bitsandbytes stored it quantized (its quant state
    beside it), else None.

    Raises:
        BitsAndBytesConfigError: a weight quantized otherwise than as NF4 in blocks of 64 (fp4, another block size or
            code table); the message names it and the fix.
    """
    tensors = index.tensors
    state_key = next((k for k in (f"{key}{QUANT_STATE}nf4", f"{key}{QUANT_STATE}fp4") if k in tensors), None)
    if state_key is None:
        return None
    file, at = tensors[key]

    def whole(name: str) -> torch.Tensor:
        return slice_reads.read_slice(slice_reads.SliceRead(file, name, 0, math.prod(tensors[name][1].shape)))

    state = json.loads(bytes(whole(state_key).tolist()))
    table = whole(f"{key}.quant_map")
    if state.get("quant_type") != "nf4" or state.get("blocksize") != 64 or table.tolist() != list(NF4_VALUES):
        raise BitsAndBytesConfigError(
            f"`{key}` in {file} is stored by bitsandbytes as {state.get('quant_type')} in blocks of"
            f" {state.get('blocksize')}; the strategy reads NF4 in blocks of 64 (bitsandbytes' default nf4). Load the"
            " unquantized checkpoint the folder was made from, with `frozen_dtype='nf4'`."
        )
    shape = tuple(state["shape"])
    nested = None
    if f"{key}.nested_absmax" in tensors:
        nested = (whole(f"{key}.nested_quant_map").float(), float(state["nested_offset"]))
    packed = PackedNF4(file, key, math.prod(shape), at, nested, int(state.get("nested_blocksize", 256)))
    return PackedNF4Source(shape, index.source(at.shape, [(key, 0)]).runs, _whole_build(packed), packed=packed)


def _whole_build(packed: PackedNF4) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """What ``TensorSource`` builds the whole weight with from its whole codes: set, so that a reader of a built source
    (``loaded.source_sha256``) reads it through :meth:`PackedNF4Source.read`, not as its runs (the codes)."""

    def build(tensors: list[torch.Tensor]) -> torch.Tensor:
        source = PackedNF4Source((packed.numel,), (), None, packed=packed)
        return source.values(tensors[0].reshape(-1), 0, packed.numel)

    return build


def say_cut_blocks(shards: Sequence[tuple[int, int]]) -> None:
    """One line where pre-quantized weights (``(numel, shard size)`` each) have shards that start inside one of
    bitsandbytes' 64-weight blocks: a shard's blocks start where it does, so each of them straddles two of the
    folder's and is quantized a second time."""
    requantized = sum(
        min(size, numel - first) for numel, size in shards for first in range(size, numel, size) if first % 64
    )
    if requantized:
        total = sum(numel for numel, _ in shards)
        rank_zero_info(
            f"lightning-frozen: {100 * requantized / total:.0f}% of the bitsandbytes nf4 weights lie in shards that"
            " start inside one of the folder's 64-weight blocks (a weight's size / ranks is no multiple of 64): each"
            " block of such a shard straddles two of the folder's, so its weights are dequantized and quantized again,"
            " which adds NF4's rounding error (up to about 0.14 of a block's absmax) once more; the other shards keep"
            " the folder's codes. A number of ranks that leaves each shard a multiple of 64 weights avoids it."
        )


def refuse_quantized_folder(folder: Path, checkpoint_path: Path) -> None:
    """The merged export's check of the base ``folder`` it reads (``checkpoint_path``'s).

    Raises:
        UnsupportedConfigurationError: its config.json holds a ``quantization_config``: the export adds the adapter to
            the folder's weights as they are stored; the message names the format and the fix.
    """
    config = folder / "config.json"
    stored = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if not isinstance(stored, dict):
        return
    settings = transformers_loading.stored_settings(stored, str(folder))
    held = f"quantized by {settings.quant_method}"
    if settings.quant_method == "bitsandbytes":
        held = f"bitsandbytes stored as {'8-bit' if settings.load_in_8bit else f'4-bit {settings.quant_type}'}"
    raise UnsupportedConfigurationError(
        f"{checkpoint_path} was trained on {folder}, which holds weights {held}: the merged export adds the adapter"
        " to unquantized weights, and a delta merged into quantized codes would mostly round away. Dequantize the base"
        " once (with bitsandbytes installed: `AutoModelForCausalLM.from_pretrained(folder).dequantize()"
        ".save_pretrained(unquantized)`), then pass `base=unquantized` (`--base` on the command line): its weights"
        " are the ones the checkpoint's fingerprint is of. Or serve the adapter: `export_peft_adapter`."
    )
