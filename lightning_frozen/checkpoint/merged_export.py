"""Export an adapter checkpoint as a merged Hugging Face model for serving, one tensor at a time.

The adapted model is built on the meta device and holds no memory; its trained tensors come from the checkpoint, its
frozen ones from the base folder by positioned reads, checksummed as read and verified against the fingerprint before
the folder is published. Each tuner layer is merged by PEFT's own ``merge`` with its base weights read just for it;
other tensors are copied through in chunks, into shards whose headers are planned beforehand. A tensor transformers
converts at load (a MoE's fused experts) is built, merged and written back through transformers' own converter and
reversal (``hf/merging.py``), under the keys ``save_pretrained`` writes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import struct
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_frozen.base import slice_reads
from lightning_frozen.base.fingerprint import ReadSums, fingerprint_base, verify_base
from lightning_frozen.capabilities import CONVERTED_EXPORT, require
from lightning_frozen.checkpoint.atomic_files import check_output_folder, folder_written_whole
from lightning_frozen.checkpoint.file import PathLike, checked_path, read_checkpoint
from lightning_frozen.checkpoint.peft_export import peft_entry_of
from lightning_frozen.errors import (
    BaseFolderError,
    CheckpointFormatError,
    InvalidArgumentValueError,
    UnsupportedConfigurationError,
    format_names,
)
from lightning_frozen.format import layout
from lightning_frozen.hf import conversions, merging
from lightning_frozen.progress import Progress
from lightning_frozen.zero.frozen_compute import KERNELS, frozen_compute_for

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# the base folder's files that are not copied: its weights (written merged) and its config (written anew)
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|onnx)$|.*\.index\.json$")
_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
# elements read, checksummed, cast and written at a time for a tensor that is copied through (16 MiB in bf16)
CHUNK_ELEMENTS = 1 << 23
# bytes handed to the writing thread and not yet written, beyond one tensor (see _ShardWriter)
WRITE_AHEAD_BYTES = 16 << 20
# bytes a shard is written between two flushes to disk
SYNC_EVERY_BYTES = 256 << 20
_DTYPE_NAMES = {dtype: name for name, dtype in slice_reads.SAFETENSORS_DTYPES.items()}
_PEFT_WAY = (
    "Merge it with PEFT itself: `export_peft_adapter`, then `PeftModel.from_pretrained(base, ...).merge_and_unload()`."
)
_IF_INTENDED = "merge with PEFT itself (`export_peft_adapter`, then PEFT's `merge_and_unload`)"


@dataclass
class _Tensor:
    """One tensor of the output: its name, dtype and shape, where its values come from, and the fingerprint record
    its read counts for (a stand-in of the recorded dtype), if any."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    folder_key: Optional[str] = None
    value: Optional[torch.Tensor] = None  # a trained tensor, from the checkpoint
    record: Optional[torch.Tensor] = None
    conversion: Optional[conversions.Conversion] = None  # built by transformers from these folder tensors

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class _Experts:
    """A converted tensor (a layer's experts fused) read, merged and written one expert at a time: each folder tensor of
    an expert is one run of the converted tensor, where transformers' converter puts it; it is counted in the
    fingerprint there and merged with PEFT's delta of that expert, if the tensor is adapted."""

    tensor: _Tensor  # the converted tensor: its dtype (the merge's), shape and fingerprint record
    runs: list[list[tuple[_Tensor, int]]]  # each expert's folder tensors as written, with their flat start in it
    wrapper: Optional[nn.Module] = None  # PEFT's ParamWrapper adapting it


@dataclass
class _Item:
    """A step of the pass: a tuner layer (or wrapper) merged whole, or one tensor of a plain module copied through."""

    tensors: list[_Tensor]  # by model name
    unit: Optional[nn.Module] = None
    lead: str = ""  # the unit's name and a dot, before the names of what PEFT puts in its place
    reads: list[tuple[nn.Module, str, _Tensor]] = field(default_factory=list)  # a unit's base tensors to fill
    missing: list[str] = field(default_factory=list)  # a unit's tensors in neither the checkpoint nor the folder
    outputs: list[_Tensor] = field(default_factory=list)  # what is written: ``tensors`` as save_pretrained writes them
    experts: list[_Experts] = field(default_factory=list)  # where ``tensors`` are written one expert at a time


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
    stored = _folder_tensors(base_folder)
    copied = sorted(p.name for p in base_folder.iterdir() if p.is_file() and not _WEIGHT_FILE.match(p.name))
    copied = [name for name in copied if name != CONFIG_NAME and not name.startswith(".")]
    ours = set(copied) | {CONFIG_NAME, INDEX_NAME, merging.GENERATION_CONFIG_NAME}

    def replaceable(name: str) -> bool:
        return name in ours or bool(_SHARD.match(name))

    check_output_folder(folder, replaceable)
    adapted = _adapted_model(checkpoint, entry, base_folder, stored, checkpoint_path)
    model = adapted.model
    reason = merging.unmergeable(model)
    if reason:
        raise UnsupportedConfigurationError(
            f"{checkpoint_path}: its {entry[layout.PEFT_CONFIG].get('peft_type')} adapter cannot be merged into the"
            f" base ({reason}). Export it with `lightning_frozen.export_peft_adapter` and serve it as an adapter."
        )
    quantized = layout.quantized_dtype_of(checkpoint)
    if quantized:
        rank_zero_info(
            f"lightning-frozen: {checkpoint_path} was trained on a base stored as {quantized}; the adapter is merged"
            f" into the original weights of {base_folder}, which its fingerprint is of."
        )
    plan = _Plan(adapted, entry, checkpoint, stored, wanted_dtype)
    untied = plan.untied()
    if untied:
        rank_zero_warn(
            f"lightning-frozen: the adapter changed {format_names(untied)}, tied to other weights in the base: the"
            " merged model holds both, untied (`tie_word_embeddings: false` in its config.json)."
        )
    shards = _shards(plan.items, limit)
    # glibc gives each freed layer back: a process keeps no heap of the model's size after the pass
    give_back = frozen_compute_for(torch.device("cpu")).set_process_memory()
    with folder_written_whole(folder, replaceable) as written:
        try:
            _write_tensors(plan, shards, written)
        finally:
            if give_back is not None:
                give_back()
        verify_base(
            plan.recorded,
            plan.stand_ins,
            layout.reference_of(checkpoint),
            str(checkpoint_path),
            functools.partial(fingerprint_base, loaded=plan.sums),
            if_intended=_IF_INTENDED,
        )
        if len(shards) > 1:
            weight_map = {t.name: name for name, shard in shards for t in shard}
            index = {"metadata": {"total_size": sum(t.nbytes for _, s in shards for t in s)}, "weight_map": weight_map}
            (written / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for name in copied:
            shutil.copyfile(base_folder / name, written / name)
        merging.written_config(merging.inner_model(model), adapted.config, written, plan.dtype, bool(untied))
    return folder


def _dtype_argument(dtype: Optional[Union[str, torch.dtype]]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None) if isinstance(dtype, str) else None
    if isinstance(found, torch.dtype) and found.is_floating_point:
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


def _folder_tensors(base: Path) -> dict[str, tuple[str, slice_reads.StoredTensor]]:
    """Each safetensors tensor of the base folder by key: its file and where it lies."""
    index = base / INDEX_NAME
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (base / WEIGHTS_NAME).exists():
        files = [WEIGHTS_NAME]
    else:
        raise BaseFolderError(
            f"{base} holds no safetensors weights (`model.safetensors` or its index), the only ones the merged export"
            " reads. Save the base with `save_pretrained` (transformers writes safetensors) and pass it as `base=`"
            " (`--base` on the command line)."
        )
    return {
        key: (str(base / name), at) for name in files for key, at in slice_reads.read_header(str(base / name)).items()
    }


@dataclass
class _Adapted:
    """The PEFT model the run trained, on the meta device, with the checkpoint's tensors of it in place; the base
    folder's config; each tensor's names in the model without the adapter; where those names come from in the folder."""

    model: Any
    config: Any
    names_of: dict[int, list[str]]
    layout: conversions.FolderLayout


def _adapted_model(
    checkpoint: Mapping[str, Any],
    entry: Mapping[str, Any],
    base: Path,
    stored: Mapping[str, Any],
    source: Path,
) -> _Adapted:
    """The :class:`_Adapted` model of the checkpoint: of the class it recorded, or else of the folder's model classes
    the one whose tensors are the checkpoint's (its fingerprint and trained names).

    Raises:
        CheckpointFormatError: no model class of the folder has the checkpoint's tensors.
    """
    config = merging.folder_config(base)
    lead = f"{entry[layout.PEFT_PREFIX]}." if entry[layout.PEFT_PREFIX] else ""
    several, _ = layout.peft_entries_of(layout.frozen_base_of(checkpoint))
    entries = dict(several) or {entry[layout.ADAPTER_NAME]: entry}  # every adapter of the run: its layers' structure
    trained = [n for n in [*layout.adapter_tensor_names(entry), *entry[layout.NOT_IN_ADAPTER]] if n.startswith(lead)]
    others = [
        name for other in entries.values() for name in layout.adapter_tensor_names(other) if name.startswith(lead)
    ]
    recorded = [name for name in layout.fingerprint_tensors(layout.fingerprint_of(checkpoint)) if name.startswith(lead)]
    expected = {name[len(lead) :] for name in [*trained, *others, *recorded]}
    outside = [name for name in entry[layout.NOT_IN_ADAPTER] if not name.startswith(lead)]
    if outside:
        rank_zero_warn(
            f"lightning-frozen: {len(outside)} trainable tensors are outside the PEFT model and not in the merged"
            f" model: {format_names(outside)}."
        )
    peft_configs = {name: other[layout.PEFT_CONFIG] for name, other in entries.items()}
    differences = []
    saved_class = entry.get(layout.ADAPTED_CLASS)  # absent from older files: the likeliest classes are tried
    for model_class in merging.model_classes(config, entry[layout.PEFT_CONFIG].get("task_type"), saved_class):
        plain = merging.meta_model(model_class, config)
        # each tensor's names in the plain model (several where tied): PEFT's injection keeps the tensors
        names_of: dict[int, list[str]] = {}
        for name, tensor in [*plain.named_parameters(remove_duplicate=False), *plain.named_buffers()]:
            names_of.setdefault(id(tensor), []).append(name)
        folder = conversions.folder_layout(plain, list(stored))
        try:
            model = merging.adapted(plain, peft_configs, entry[layout.ADAPTER_NAME])
        except (ValueError, TypeError, AttributeError) as error:  # PEFT refuses the adapter on this class
            differences.append(f"{model_class.__name__}: {type(error).__name__}: {error}")
            continue
        except (RuntimeError, NotImplementedError) as error:  # PEFT computes from the base as it creates a layer
            raise UnsupportedConfigurationError(
                f"{source}: PEFT cannot create this adapter's layers without their base weights"
                f" ({type(error).__name__}: {str(error)[:200]}), so the merged export cannot merge it. {_PEFT_WAY}"
            ) from error
        params = {name for name, _ in model.named_parameters() if ".original_module." not in name}
        # a tuner's frozen state may be a buffer where PEFT builds on the meta device: its merge says what it lacks
        tensors = params | {name for name, _ in model.named_buffers()}
        if params <= expected <= tensors:
            state_dict = layout.state_dict_of(checkpoint)
            buffers = {name for name, _ in model.named_buffers()}
            values = {name[len(lead) :]: state_dict[name] for name in trained}
            values |= {
                n[len(lead) :]: v for n, v in state_dict.items() if n.startswith(lead) and n[len(lead) :] in buffers
            }
            model.load_state_dict(values, strict=False, assign=True)
            return _Adapted(model, config, names_of, folder)
        differences.append(
            f"{model_class.__name__}: lacks {format_names(sorted(expected - tensors))}, has"
            f" {format_names(sorted(params - expected))}"
        )
    raise CheckpointFormatError(
        f"{source}: no model class of {base} holds the tensors the checkpoint was trained with"
        f" ({'; '.join(differences)}). Was the module built from this folder with another class or other"
        " `from_pretrained` arguments?"
    )


class _Plan:
    """The tensors the merged folder holds, in the order they are read and written, and the fingerprint records the
    base folder's tensors are verified against."""

    def __init__(
        self,
        adapted: _Adapted,
        entry: Mapping[str, Any],
        checkpoint: Mapping[str, Any],
        stored: Mapping[str, tuple[str, slice_reads.StoredTensor]],
        wanted_dtype: Optional[torch.dtype],
    ) -> None:
        model = adapted.model
        inner = self.inner = merging.inner_model(model)
        self.adapter = entry[layout.ADAPTER_NAME]
        self.names_of = adapted.names_of
        self.keys = adapted.layout.keys
        self.conversions = adapted.layout.conversions
        self.used = adapted.layout.used
        if self.used:  # its keys are written back as save_pretrained reverts them
            require(CONVERTED_EXPORT)
        self.model_type = getattr(adapted.config, "model_type", type(inner).__name__)
        self.stored = stored
        read = [*self.keys.values(), *(key for c in self.conversions.values() for key in c.keys)]
        folder_dtypes = [stored[key][1].dtype for key in read if stored[key][1].dtype.is_floating_point]
        self.dtype = wanted_dtype or max(set(folder_dtypes), key=folder_dtypes.count, default=torch.float32)
        self.wanted_dtype = wanted_dtype
        lead = f"{entry[layout.PEFT_PREFIX]}." if entry[layout.PEFT_PREFIX] else ""
        fingerprint = layout.fingerprint_of(checkpoint)
        self.recorded = dict(fingerprint)
        records = {n: r for n, r in layout.fingerprint_tensors(fingerprint).items() if n.startswith(lead)}
        self.recorded[layout.DIGEST] = None  # compared tensor by tensor: only those of the PEFT model's base
        self.sums = ReadSums(fingerprint.get(layout.FINGERPRINT_MODE, "none"), KERNELS)
        verified: dict[str, Any] = {}
        self.stand_ins: list[tuple[str, torch.Tensor]] = []
        # each recorded tensor by the folder key its values are read from: counted at the first read of that key
        self.pending: dict[str, torch.Tensor] = {}
        params = dict(model.named_parameters())
        for name, record in records.items():
            dtype = getattr(torch, record[layout.DTYPE])
            stand_in = torch.empty(record[layout.SHAPE], dtype=dtype, device="meta")
            param = params.get(name[len(lead) :])
            key = self._key_of(param) if param is not None else None
            if key is None:  # a tuner's own frozen state: the merge of its layer needs it, and says so
                continue
            self.stand_ins.append((name, stand_in))
            self.pending[key] = stand_in
            verified[name] = record
        self.recorded[layout.TENSORS] = verified
        self.items: list[_Item] = []
        self.tied: dict[int, list[str]] = {i: names for i, names in self.names_of.items() if len(names) > 1}
        self.changed: set[str] = set()
        for name, module, is_unit in merging.merge_units(inner):
            lead_name = f"{name}." if name else ""
            if is_unit:
                self.items.append(self._unit_item(lead_name, module))
                continue
            own = [(k, t) for k, t in module.state_dict(keep_vars=True).items() if "." not in k]
            tensors = [self._tensor(f"{lead_name}{k}", t) for k, t in own]
            self.items.extend(_Item([t]) for t in tensors)
        self._drop_tied_copies()
        self.items.sort(key=self._file_order)
        self._check_conversions()
        for item in self.items:
            item.outputs = self._outputs(item)
            item.experts = self._by_expert(item)
            if item.experts:
                item.outputs = [t for experts in item.experts for runs in experts.runs for t, _ in runs]

    def _conversion_of(self, tensor: torch.Tensor) -> Optional[conversions.Conversion]:
        names = self.names_of.get(id(tensor), [])
        return next((self.conversions[n] for n in names if n in self.conversions), None)

    def _key_of(self, tensor: torch.Tensor) -> Optional[str]:
        """The folder key ``tensor``'s values are read from: its own, or the first of those it is converted from."""
        conversion = self._conversion_of(tensor)
        if conversion is not None:
            return conversion.keys[0]
        return next((self.keys[n] for n in self.names_of.get(id(tensor), []) if n in self.keys), None)

    def _refused(self, what: str) -> UnsupportedConfigurationError:
        return UnsupportedConfigurationError(
            f"transformers converts the tensors of this {self.model_type!r} base as it loads them, and {what}, so the"
            f" merged export cannot write it as `save_pretrained` does. {_PEFT_WAY}"
        )

    def _check_conversions(self) -> None:
        """Each conversion builds one model tensor (transformers' own converter, run on meta tensors).

        Raises:
            UnsupportedConfigurationError: one builds several (split across layers), or transformers cannot run it.
        """
        for conversion in self.conversions.values():
            inputs = [torch.empty(self.stored[key][1].shape, device="meta") for key in conversion.keys]
            try:
                built = conversions.converted(self.inner, conversion, inputs)
            except Exception as error:  # whatever the converter raises: named in the refusal, before any write
                raise self._refused(
                    f"its converter for `{conversion.target}` fails on the folder's tensors"
                    f" ({type(error).__name__}: {error})"
                ) from error
            if list(built) != [conversion.target]:
                raise self._refused(f"it splits {format_names(conversion.keys)} into {format_names(list(built))}")

    def _outputs(self, item: _Item) -> list[_Tensor]:
        """The tensors written for ``item``: its tensors reverted by transformers (on meta tensors) to the keys and
        layout ``save_pretrained`` writes.

        Raises:
            UnsupportedConfigurationError: transformers cannot revert a conversion of the item's tensors.
        """
        meta = {t.name: torch.empty(t.shape, dtype=t.dtype, device="meta") for t in item.tensors}
        try:
            written = merging.reverted(self.inner, self.used, meta)
        except Exception as error:  # a conversion without a reverse op raises whatever its op raises
            names = format_names(list(meta))
            raise self._refused(f"cannot revert it for {names} ({type(error).__name__}: {error})") from error
        return [_Tensor(name, value.dtype, tuple(value.shape)) for name, value in written.items()]

    def _out_dtype(self, key: Optional[str], fallback: torch.dtype) -> torch.dtype:
        own = self.stored[key][1].dtype if key is not None else fallback
        if not own.is_floating_point:
            return own
        return self.wanted_dtype or (own if key is not None else self.dtype)

    def _tensor(self, name: str, tensor: torch.Tensor) -> _Tensor:
        key = self._key_of(tensor) if tensor.is_meta else None
        if tensor.is_meta and key is None:
            raise BaseFolderError(
                f"The merged model needs `{name}`, which is neither in the base folder nor trained. Pass the folder the"
                " run loaded its base from as `base=` (`--base` on the command line)."
            )
        value = None if tensor.is_meta else tensor.detach()
        dtype = self._out_dtype(key, tensor.dtype)
        record = self.pending.pop(key, None) if key else None
        return _Tensor(name, dtype, tuple(tensor.shape), key, value, record, self._conversion_of(tensor))

    def _unit_item(self, lead: str, unit: nn.Module) -> _Item:
        """A tuner layer or wrapper: its meta tensors to read, and the tensors of what PEFT puts in its place."""
        item = _Item([], unit, lead)
        for module_name, module in merging.merge_inputs(unit):
            for attr, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if not tensor.is_meta:
                    continue
                name = ".".join(part for part in (lead[:-1], module_name, attr) if part)
                key = self._key_of(tensor)
                if key is None:  # state PEFT computes when it creates the layer
                    item.missing.append(name)
                    continue
                at = _Tensor(name, self._out_dtype(key, tensor.dtype), tuple(tensor.shape), key)
                at.record = self.pending.pop(key, None)
                at.conversion = self._conversion_of(tensor)
                item.reads.append((module, attr, at))
        for k, tensor in merging.unloaded_module(unit).state_dict(keep_vars=True).items():
            key = self._key_of(tensor)
            item.tensors.append(_Tensor(f"{lead}{k}", self._out_dtype(key, tensor.dtype), tuple(tensor.shape)))
            self.changed.add(f"{lead}{k}")
        return item

    def _by_expert(self, item: _Item) -> list[_Experts]:
        """The item's converted tensors, one expert at a time, where each of its tensors is converted (a unit: PEFT's
        ``ParamWrapper`` alone, nested, each adapting one) and transformers' reversal writes each back as the folder
        stores it; else none (the item is converted and merged whole)."""
        if item.unit is None:
            reads = [(None, "", t) for t in item.tensors if t.value is None]
        elif hasattr(item.unit, "get_delta_factors") and not item.missing:
            reads = item.reads
        else:
            return []
        found = []
        revert = functools.partial(merging.reverted, self.inner, self.used)  # values checked too, not only names
        for module, attr, tensor in reads:
            shapes = {k: self.stored[k][1].shape for k in tensor.conversion.keys} if tensor.conversion else {}
            runs = tensor.conversion and conversions.expert_runs(self.inner, tensor.conversion, shapes, revert)
            units = item.unit.modules() if item.unit is not None else []
            wrappers = [m for m in units if getattr(m, "parameter_name", None) == attr and m.get_base_layer() is module]
            if not runs or (item.unit is not None and not wrappers):
                return []
            outputs = [
                [(_Tensor(key, self._out_dtype(key, tensor.dtype), tuple(shapes[key])), start) for key, start in expert]
                for expert in runs
            ]
            found.append(_Experts(tensor, outputs, wrappers[0] if wrappers else None))
        written = {(t.name, t.shape) for t in item.outputs}
        if written != {(t.name, t.shape) for e in found for runs in e.runs for t, _ in runs}:
            return []  # transformers writes them back otherwise than the folder stores them
        return found

    def _drop_tied_copies(self) -> None:
        """Of weights tied in the base that no adapter changed, only the first name is written (as ``save_pretrained``
        writes them); ``from_pretrained`` ties them again."""
        dropped = set()
        for names in self.tied.values():
            if not any(name in self.changed for name in names):
                dropped.update(names[1:])
        self.items = [item for item in self.items if item.unit is not None or item.tensors[0].name not in dropped]

    def untied(self) -> list[str]:
        """The tied weights the adapter changed, which the merged model holds untied."""
        return sorted({n for names in self.tied.values() if any(x in self.changed for x in names) for n in names})

    def _file_order(self, item: _Item) -> tuple[str, int]:
        keys = [t.folder_key for _, _, t in item.reads] or [t.folder_key for t in item.tensors]
        key = next((k for k in keys if k is not None), None)
        if key is None:
            return ("\uffff", 0)  # trained tensors alone: after every read
        path, at = self.stored[key]
        return path, at.offset


def _shards(items: list[_Item], limit: int) -> list[tuple[str, list[_Tensor]]]:
    """The output tensors in shards of at most ``limit`` bytes (a larger tensor alone), named as ``save_pretrained``
    names them."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in (t for item in items for t in item.outputs):
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    if len(shards) == 1:
        return [(WEIGHTS_NAME, shards[0])]
    return [(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", s) for i, s in enumerate(shards)]


class _ShardWriter:
    """The shards, each written as its tensors come in the planned order: its header first, then each tensor's bytes.

    A thread writes while the caller merges the next layer, holding at most ``WRITE_AHEAD_BYTES`` (or one tensor) not
    yet written, and flushes each shard to disk every ``SYNC_EVERY_BYTES``, so that the disk writes as the pass goes
    instead of all at the final fsync."""

    def __init__(self, folder: Path, shards: list[tuple[str, list[_Tensor]]], progress: Progress) -> None:
        self._order = [
            (folder / name if i == 0 else None, tensors, t) for name, tensors in shards for i, t in enumerate(tensors)
        ]
        self._order.reverse()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-frozen-write")
        self._pending: deque[tuple[Future, int]] = deque()
        self._file: Optional[IO[bytes]] = None
        self._unsynced = 0
        self._current: Optional[_Tensor] = None
        self._left = 0
        self._progress = progress

    def write(self, name: str, values: torch.Tensor) -> None:
        """Append ``values``: the next elements of the tensor ``name``, in its output dtype."""
        if self._left == 0:
            path, tensors, self._current = self._order.pop()
            if path is not None:
                self._submit(functools.partial(self._open, path, tensors), 0)
            self._left = self._current.nbytes
        data = values.contiguous().reshape(-1).view(torch.uint8)
        assert self._current is not None and self._current.name == name and data.numel() <= self._left, name
        self._submit(functools.partial(self._append, data), data.numel())
        self._left -= data.numel()
        if self._left == 0 and self._progress.advance(self._current.nbytes):
            status = self._progress.status("MiB", 2**20)
            rank_zero_info(f"lightning-frozen: writing the merged model: {self._progress.items} tensors, {status}")

    def close(self) -> None:
        """Wait for every write, close the last shard; raise what a write raised."""
        try:
            self._submit(self._close, 0)
            while self._pending:
                self._pending.popleft()[0].result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, work: Any, nbytes: int) -> None:
        self._pending.append((self._pool.submit(work), nbytes))
        while len(self._pending) > 1 and sum(n for _, n in self._pending) > WRITE_AHEAD_BYTES:
            self._pending.popleft()[0].result()
        while self._pending and self._pending[0][0].done():
            self._pending.popleft()[0].result()

    def _open(self, path: Path, tensors: list[_Tensor]) -> None:
        self._close()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor in tensors:
            end = offset + tensor.nbytes
            header[tensor.name] = {
                "dtype": _DTYPE_NAMES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes, padding the header with spaces
        self._file = open(path, "wb")  # noqa: SIM115  (open across the writes of its tensors, closed by _close)
        self._file.write(struct.pack("<Q", len(text)) + text)

    def _append(self, data: torch.Tensor) -> None:
        assert self._file is not None
        self._file.write(data.numpy())
        self._unsynced += data.numel()
        if self._unsynced >= SYNC_EVERY_BYTES:
            self._file.flush()
            os.fdatasync(self._file.fileno())
            self._unsynced = 0

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _reads(plan: _Plan) -> tuple[list[slice_reads.SliceRead], list[Optional[tuple[_Tensor, int]]]]:
    """Every read of the pass, in order (a unit's base tensors whole, a copied tensor in chunks, each folder tensor of a
    converted one whole), and for each the tensor whose fingerprint record it counts for and where, if any (a tensor
    converted whole is counted once built)."""
    reads: list[slice_reads.SliceRead] = []
    counted: list[Optional[tuple[_Tensor, int]]] = []
    for item in plan.items:
        for experts in item.experts:
            for tensor, start in (run for runs in experts.runs for run in runs):
                path, at = plan.stored[tensor.name]
                reads.append(slice_reads.SliceRead(path, tensor.name, 0, math.prod(at.shape)))
                counted.append((experts.tensor, start) if experts.tensor.record is not None else None)
        if item.experts:
            continue
        tensors = [t for _, _, t in item.reads] if item.unit is not None else item.tensors
        for tensor in tensors:
            if tensor.folder_key is None or tensor.value is not None:
                continue
            if tensor.conversion is not None:
                for key in tensor.conversion.keys:
                    path, at = plan.stored[key]
                    reads.append(slice_reads.SliceRead(path, key, 0, math.prod(at.shape)))
                    counted.append(None)
                continue
            path, at = plan.stored[tensor.folder_key]
            numel = math.prod(at.shape)
            step = numel if item.unit is not None else CHUNK_ELEMENTS
            starts = range(0, numel, step) if numel else range(1)
            reads += [slice_reads.SliceRead(path, tensor.folder_key, s, min(step, numel - s)) for s in starts]
            counted += [(tensor, s) if tensor.record is not None else None for s in starts]
    return reads, counted


def _write_tensors(plan: _Plan, shards: list[tuple[str, list[_Tensor]]], folder: Path) -> None:
    """The pass: every read of the base folder, each unit merged by PEFT, every tensor written as it comes."""
    writer = _ShardWriter(folder, shards, Progress(sum(t.nbytes for _, s in shards for t in s)))
    reads, counted = _reads(plan)

    def count(index: int, values: torch.Tensor) -> None:  # on the reading thread, beside the merge
        if counted[index] is not None:
            tensor, start = counted[index]
            plan.sums.add(tensor.record, values.to(tensor.record.dtype), start)

    try:
        with torch.no_grad(), slice_reads.read_ahead(reads, count) as slices:
            for item in plan.items:
                tensor = item.tensors[0] if item.tensors else None
                if item.experts:
                    _write_by_expert(plan, item, slices, writer)
                elif item.unit is not None:
                    _write_reverted(plan, item, _merge_unit(plan, item, slices), writer)
                elif tensor is not None and tensor.value is not None:
                    _write_reverted(plan, item, {tensor.name: tensor.value}, writer)
                elif tensor is not None and tensor.conversion is not None:
                    _write_reverted(plan, item, {tensor.name: _converted(plan, tensor, slices)}, writer)
                else:
                    _copy_through(tensor, item.outputs[0], slices, writer)
    finally:
        writer.close()


def _write_reverted(plan: _Plan, item: _Item, values: dict[str, torch.Tensor], writer: _ShardWriter) -> None:
    """``values`` (an item's tensors by model name) reverted by transformers as ``save_pretrained`` reverts them, each
    written in its output dtype."""
    written = merging.reverted(plan.inner, plan.used, {t.name: values[t.name] for t in item.tensors})
    for tensor in item.outputs:
        writer.write(tensor.name, written.pop(tensor.name).to(tensor.dtype))


def _write_by_expert(plan: _Plan, item: _Item, slices: Iterator[torch.Tensor], writer: _ShardWriter) -> None:
    """Each converted tensor of ``item`` one expert at a time: its folder tensors, each with its run of PEFT's delta of
    that expert added (as PEFT's merge adds the whole delta, in the converted tensor's dtype), written as read."""
    for experts in item.experts:
        delta_of = merging.expert_delta(experts.wrapper, plan.adapter) if experts.wrapper is not None else None
        size = math.prod(experts.tensor.shape[1:])
        for expert, runs in enumerate(experts.runs):
            delta = None if delta_of is None else delta_of(expert).reshape(-1).to(experts.tensor.dtype)
            for tensor, start in runs:
                values = next(slices).to(experts.tensor.dtype)
                if delta is not None:
                    begin = start - expert * size
                    values = values + delta[begin : begin + values.numel()]
                writer.write(tensor.name, values.to(tensor.dtype))


def _converted(plan: _Plan, tensor: _Tensor, slices: Iterator[torch.Tensor]) -> torch.Tensor:
    """A tensor transformers builds from folder tensors: each read whole (one at a time), then transformers' own
    converter; counted in the fingerprint as built, as the loader built it."""
    assert tensor.conversion is not None
    # handed over one by one and held by the converter alone, which frees each list once it has stacked it
    parts = (next(slices).reshape(plan.stored[key][1].shape) for key in tensor.conversion.keys)
    built = conversions.converted(plan.inner, tensor.conversion, parts)[tensor.conversion.target]
    if tensor.record is not None:
        plan.sums.add(tensor.record, built.to(tensor.record.dtype), 0)
    return built.to(tensor.dtype)


def _copy_through(tensor: _Tensor, output: _Tensor, slices: Iterator[torch.Tensor], writer: _ShardWriter) -> None:
    """A tensor of the base folder, in the chunks :func:`_reads` planned: cast, written under its output name."""
    for _ in range(max(1, math.ceil(math.prod(tensor.shape) / CHUNK_ELEMENTS))):
        writer.write(output.name, next(slices).to(output.dtype))


def _merge_unit(plan: _Plan, item: _Item, slices: Iterator[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tuner layer or wrapper: its base tensors read whole into it, PEFT's merge; returns what PEFT puts in its place
    by model name. The base tensors are then freed (back on the meta device).

    Raises:
        UnsupportedConfigurationError: the merge needs tensors PEFT computes when it creates the layer.
    """
    assert item.unit is not None
    for module, attr, tensor in item.reads:
        if tensor.conversion is not None:
            whole = _converted(plan, tensor, slices)
        else:
            whole = next(slices).to(tensor.dtype).reshape(tensor.shape)
        is_param = attr in dict(module.named_parameters(recurse=False))
        setattr(module, attr, nn.Parameter(whole, requires_grad=False) if is_param else whole)
    try:
        merged = merging.merged_module(item.unit, plan.adapter).state_dict()
    except (RuntimeError, NotImplementedError):
        if not item.missing:
            raise
        merged = {"": torch.empty(0, device="meta")}  # refused below, naming what the layer lacks
    if any(value.is_meta for value in merged.values()):
        raise UnsupportedConfigurationError(
            f"The adapter's layer `{item.lead[:-1]}` needs {format_names(item.missing)}, in neither the checkpoint nor"
            " the base folder (PEFT computes it when it creates the layer), so the merged export cannot merge this"
            f" tuner. {_PEFT_WAY}"
        )
    values = {tensor.name: merged[tensor.name[len(item.lead) :]] for tensor in item.tensors}
    for module, attr, tensor in item.reads:  # freed; the adapter's tensors stay (views of the checkpoint file)
        placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        is_param = attr in dict(module.named_parameters(recurse=False))
        setattr(module, attr, nn.Parameter(placeholder, requires_grad=False) if is_param else placeholder)
    return values
