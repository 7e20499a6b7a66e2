"""Export an adapter checkpoint as a merged Hugging Face model for serving, one tensor at a time.

One flow, data going one way: the checkpoint and the base folder's index (``base/slice_reads.py``); the adapted model
built on the meta device, holding no memory, and described part by part, shape only (``hf/merging.py``); a plan of
steps built from that description, and its one pass (``checkpoint/merge_plan.py``). Frozen tensors are read
from the base folder by positioned reads, checksummed as read and verified against the fingerprint before the folder
is published. Each tuner layer is merged by PEFT's own ``merge`` with its base weights read just for it; other tensors
are copied through in chunks; a tensor transformers converts at load (a MoE's fused experts) is merged and written
back through transformers' own conversion and reversal, under the keys ``save_pretrained`` writes.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_frozen.base import prequantized
from lightning_frozen.base.slice_reads import INDEX_NAME, FolderIndex
from lightning_frozen.checkpoint.atomic_files import check_output_folder, folder_written_whole
from lightning_frozen.checkpoint.file import PathLike, checked_path, read_checkpoint
from lightning_frozen.checkpoint.merge_plan import write_merged
from lightning_frozen.checkpoint.peft_export import peft_entry_of
from lightning_frozen.errors import (
    BaseFolderError,
    InvalidArgumentValueError,
    format_names,
)
from lightning_frozen.format import layout
from lightning_frozen.format.merged_parts import MergedParts
from lightning_frozen.hf import merging
from lightning_frozen.zero.frozen_compute import frozen_compute_for

CONFIG_NAME = "config.json"
# the base folder's files that are not copied: its weights (written merged) and its config (written anew)
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx)$|.*\.index\.json$")
_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
# bytes handed to the writing thread and not yet written, beyond one tensor (see merge_plan's _ShardWriter)
WRITE_AHEAD_BYTES = 16 << 20


def export_merged(
    checkpoint_path: PathLike,
    output_dir: PathLike,
    adapter: Optional[str] = None,
    dtype: Optional[Union[str, torch.dtype]] = None,
    max_shard_size: Union[int, str] = "5GB",
    base: Optional[PathLike] = None,
) -> Path:
    """Write a Hugging Face model folder with the checkpoint's adapter merged into its base, for serving:
    ``AutoModel*.from_pretrained(output_dir)`` loads it without PEFT or DeepSpeed.

    The folder holds safetensors shards of at most ``max_shard_size`` (with their index where there are several),
    ``config.json`` with the weights' dtype (the base's, or ``dtype``: ``"bfloat16"``, ``torch.float16``...), and every
    other file of the base folder. The frozen weights are read from the base folder the checkpoint references (a hub
    id: its cached snapshot; ``base``: where the base moved), verified against its fingerprint as they are read.
    Memory holds one adapted layer and the adapter, not the model. The folder is written whole, so a failure leaves
    ``output_dir`` as it was; an existing one is replaced only when it holds an earlier merged export. Of a run that
    trained several adapters at once, ``adapter`` names the one merged. Returns ``output_dir`` (docs/checkpoints.md).

    Raises:
        TypeError: ``checkpoint_path`` or ``output_dir`` is not a path.
        FileNotFoundError, CheckpointFormatError: the file is missing, not a lightning-frozen checkpoint, or was not
            trained on a PEFT model.
        ValueError: ``adapter`` names no adapter of the checkpoint (or is None where it holds several);
            ``dtype`` or ``max_shard_size`` is not one.
        UnsupportedConfigurationError: the tuner cannot be merged (prompt learning, ...): export it with
            ``export_peft_adapter`` instead.
        BaseFolderError: the base folder is missing, holds no safetensors weights, or lacks a tensor.
        FrozenBaseFileError: a safetensors file of the base folder is truncated or corrupt.
        FrozenBaseMismatchError: the base folder is not the base the checkpoint was trained on.
        NotADirectoryError: ``output_dir`` is a file, or a folder holding other entries.
    """
    checkpoint_path = checked_path(checkpoint_path, "checkpoint_path", "export_merged")
    folder = checked_path(output_dir, "output_dir", "export_merged")
    wanted_dtype = _dtype_argument(dtype)
    limit = _shard_size_argument(max_shard_size)
    checkpoint = read_checkpoint(checkpoint_path)
    entry = peft_entry_of(layout.frozen_base_of(checkpoint), adapter, checkpoint_path)
    base_folder = _base_folder(checkpoint, checkpoint_path, base)
    prequantized.refuse_quantized_folder(base_folder, checkpoint_path)
    index = FolderIndex.of_folder(base_folder)
    copied = sorted(p.name for p in base_folder.iterdir() if p.is_file() and not _WEIGHT_FILE.match(p.name))
    copied = [name for name in copied if name != CONFIG_NAME and not name.startswith(".")]
    ours = set(copied) | {CONFIG_NAME, INDEX_NAME, merging.GENERATION_CONFIG_NAME}

    def replaceable(name: str) -> bool:
        return name in ours or bool(_SHARD.match(name))

    check_output_folder(folder, replaceable)
    lead = f"{entry[layout.PEFT_PREFIX]}." if entry[layout.PEFT_PREFIX] else ""
    quantized = layout.quantized_dtype_of(checkpoint)
    if quantized:
        rank_zero_info(
            f"lightning-frozen: {checkpoint_path} was trained on a base stored as {quantized}; the adapter is merged"
            f" into the original weights of {base_folder}, which its fingerprint is of."
        )
    merged = _merged_parts(checkpoint, entry, lead, base_folder, index, wanted_dtype, checkpoint_path)
    if merged.untied:
        rank_zero_warn(
            f"lightning-frozen: the adapter changed {format_names(merged.untied)}, tied to other weights in the base:"
            " the merged model holds both, untied (`tie_word_embeddings: false` in its config.json)."
        )
    # glibc gives each freed layer back: a process keeps no heap of the model's size after the pass
    give_back = frozen_compute_for(torch.device("cpu")).set_process_memory()
    with folder_written_whole(folder, replaceable) as written:
        try:
            write_merged(merged, index, checkpoint, str(checkpoint_path), lead, limit, written, WRITE_AHEAD_BYTES)
        finally:
            if give_back is not None:
                give_back()
        for name in copied:
            shutil.copyfile(base_folder / name, written / name)
        merged.write_config(written)
    return folder


def _dtype_argument(dtype: Optional[Union[str, torch.dtype]]) -> Optional[torch.dtype]:
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if dtype is None or isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    raise InvalidArgumentValueError(
        f'`export_merged`: `dtype` must be a floating-point torch dtype or its name ("bfloat16", "float16",'
        f' "float32"), got {dtype!r}.'
    )


def _shard_size_argument(size: Union[int, str]) -> int:
    try:
        limit = merging.shard_bytes(size)
    except (ValueError, TypeError):
        limit = 0
    if limit <= 0:
        raise InvalidArgumentValueError(
            f'`export_merged`: `max_shard_size` must be a positive size such as "5GB" or "500MB" or a number of'
            f" bytes, got {size!r}."
        )
    return limit


def _base_folder(checkpoint: Mapping[str, Any], source: Path, base: Optional[PathLike]) -> Path:
    """``base``, else the base folder the checkpoint references, else the cached hub snapshot it names.

    Raises:
        BaseFolderError: none of them is a folder here.
    """
    reference = layout.reference_of(checkpoint)
    if base is not None:
        found: Optional[Path] = checked_path(base, "base", "export_merged")
    elif reference and Path(reference).is_dir():
        found = Path(reference)
    else:
        found = merging.cached_snapshot(reference) if reference else None
    if found is not None and found.is_dir():
        return found
    raise BaseFolderError(
        f"{source} was trained on the frozen base {reference!r}, {'and ' + repr(str(base)) if base else 'which'} is"
        " no folder here (nor a hub model in the local cache). Pass the base folder: `export_merged(...,"
        " base='path/to/base')`, or `--base path/to/base` to `lightning-frozen export-merged`; it is verified against"
        " the checkpoint's fingerprint all the same."
    )


def _merged_parts(
    checkpoint: Mapping[str, Any],
    entry: Mapping[str, Any],
    lead: str,
    base: Path,
    index: FolderIndex,
    dtype: Optional[torch.dtype],
    source: Path,
) -> MergedParts:
    """The parts of the merged model (``hf/merging.py``), from what the checkpoint records of the PEFT model the run
    trained, under ``lead``: every adapter of the run (its layers' structure), the tensors it trained, its fingerprint's
    names."""
    outside = [name for name in entry[layout.NOT_IN_ADAPTER] if not name.startswith(lead)]
    if outside:
        rank_zero_warn(
            f"lightning-frozen: {len(outside)} trainable tensors are outside the PEFT model and not in the merged"
            f" model: {format_names(outside)}."
        )

    def own(names: Iterable[str]) -> list[str]:  # their names in the PEFT model
        return [name[len(lead) :] for name in names if name.startswith(lead)]

    several, _ = layout.peft_entries_of(layout.frozen_base_of(checkpoint))
    entries = dict(several) or {entry[layout.ADAPTER_NAME]: entry}
    trained = own([*layout.adapter_tensor_names(entry), *entry[layout.NOT_IN_ADAPTER]])
    others = own(name for other in entries.values() for name in layout.adapter_tensor_names(other))
    recorded = own(layout.fingerprint_tensors(layout.fingerprint_of(checkpoint)))
    state = layout.state_dict_of(checkpoint)
    state = {name[len(lead) :]: value for name, value in state.items() if name.startswith(lead)}
    return merging.merged_parts(
        base,
        {key: (at.dtype, at.shape) for key, (_, at) in index.tensors.items()},
        dtype,
        str(source),
        {name: other[layout.PEFT_CONFIG] for name, other in entries.items()},
        entry[layout.ADAPTER_NAME],
        entry.get(layout.ADAPTED_CLASS),  # absent from older files: the likeliest classes are tried
        {*trained, *others, *recorded},
        trained,
        state,
    )
