"""``from_pretrained`` inside ``configure_model``: Hugging Face weights straight into ZeRO-3 shards, 1/N per rank.

:func:`zero3_pretrained_loading` switches transformers' ZeRO-3 path on for ``configure_model`` and replaces its two
loading steps where the installed transformers has them (5.x): every rank takes only the shapes from the checkpoint,
then copies its own flat range of each tensor out of the safetensors file into its shard; no gather, no broadcast. A
tensor that transformers builds at load from several of the folder's (a MoE layer's experts, fused into one) is read
from the parts of those that the rank's range covers, where transformers stacks them; else its folder tensors are read
whole and built by transformers' converter, one such tensor at a time. Checkpoints this cannot slice (``.bin`` files,
a conversion that splits a tensor across params) go through transformers' own path (docs/large-models.md).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_frozen import process
from lightning_frozen.base import code_cache, prequantized, qlora, slice_reads
from lightning_frozen.base.fingerprint import Checksummer
from lightning_frozen.base.loaded import LoadedBase, source_sha256
from lightning_frozen.capabilities import CONVERTED_LOADING, available
from lightning_frozen.hf import conversions, peft_adapters, transformers_loading
from lightning_frozen.progress import Progress
from lightning_frozen.zero import placeholders
from lightning_frozen.zero.frozen_compute import KERNELS
from lightning_frozen.zero.frozen_storage import store_codes
from lightning_frozen.zero.init import outside_zero_init, sharded_creation
from lightning_frozen.zero.params import (
    compute_dtype,
    full_numel,
    full_shape,
    is_partitioned,
    local_shard,
    shard_numel,
    shard_range,
)

# the checkpoint file a shapes-only tensor stands for, set by `_shapes_only` and read by `_load_own_slices`
_SOURCE = "_lightning_frozen_source"


@dataclass
class LoadPlan:
    """How one load stores and records what it reads, handed down from the strategy's spec: ``frozen_dtype`` encodes
    each floating-point slice as it is read (a bitsandbytes ``quantization_config`` may set it, ``base/qlora.py``, and
    marks the model as bitsandbytes would, ``bitsandbytes``); ``fingerprint_mode`` is the spec's ``fingerprint``;
    ``loaded`` keeps each slice's checksum and source; ``code_cache`` is the strategy's argument (where the stored base
    is kept for the next fit: ``base/code_cache.py``)."""

    loaded: LoadedBase
    frozen_dtype: Optional[str] = None
    fingerprint_mode: str = "checksum"
    bitsandbytes: bool = False
    code_cache: process.CodeCacheSetting = False


@contextmanager
def sharded_model_creation(
    config: dict, remote_device: Optional[str], plan: Optional[LoadPlan] = None
) -> Iterator[None]:
    """Where ``configure_model`` runs: params are ZeRO-3 shards as they are created (on ``remote_device``),
    ``from_pretrained`` loads each rank's slices into them as ``plan`` says (:func:`zero3_pretrained_loading`) and
    PEFT initialises its adapters whole (:func:`peft_adapters_outside_zero_init`); each of those from the moment the
    user's code has imported transformers or PEFT (:func:`once_imported`), neither imported by the package."""
    # PEFT's methods are wrapped before `zero.Init` wraps every module class's `__init__` and put back after it
    # restored them: wrapped inside it, `zero.Init` took the wrapper for PEFT's own and restored it for good. A PEFT
    # first imported inside (by `configure_model`) is imported outside it, and wrapped there.
    with (
        once_imported("peft", peft_adapters_outside_zero_init, importing=outside_zero_init),
        sharded_creation(config, remote_device),
        once_imported("transformers.modeling_utils", functools.partial(zero3_pretrained_loading, config, plan)),
    ):
        yield


@contextmanager
def once_imported(
    name: str,
    context: Callable[[], AbstractContextManager[Any]],
    importing: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> Iterator[None]:
    """While active, ``context()`` is entered: at once where module ``name`` is imported, else as soon as the user's
    code imports it (it runs inside ``importing()``, and ``context()`` is entered there); it is left on exit. So a run
    whose user never imports transformers or PEFT imports neither (a plain torch model's ``configure_model``)."""
    with ExitStack() as stack:
        if name in sys.modules:
            stack.enter_context(context())
            yield
            return

        def imported(execute: Callable[[], None]) -> None:
            with importing():
                _WATCHED.running += 1
                try:
                    execute()
                finally:
                    _WATCHED.running -= 1
                if _WATCHED.running:  # inside another watched import (PEFT's imports transformers): once that ran
                    _WATCHED.after_outermost.append(lambda: stack.enter_context(context()))
                    return
                try:
                    stack.enter_context(context())
                    while _WATCHED.after_outermost:
                        _WATCHED.after_outermost.pop(0)()
                finally:
                    _WATCHED.after_outermost.clear()

        watch = _ImportWatch(name, imported)
        sys.meta_path.insert(0, watch)
        try:
            yield
        finally:
            watch.stop()


@dataclass
class _WatchedImports:
    """How many watched imports run now, one inside another, and what those inside enter once the outermost ran: a
    capability looked up mid-import would find the outer package half made, and stay off for the process."""

    running: int = 0
    after_outermost: list[Callable[[], Any]] = field(default_factory=list)


_WATCHED = _WatchedImports()


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Finds module ``name`` as the other finders do, and has its loader run it through ``imported(execute)``; once."""

    def __init__(self, name: str, imported: Callable[[Callable[[], None]], None]) -> None:
        self.name, self.imported = name, imported

    def stop(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            found = getattr(finder, "find_spec", None) if finder is not self else None
            spec = found(fullname, path, target) if found is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ImportedThrough(spec.loader, self)
                return spec
        return None


class _ImportedThrough:
    """``loader``, whose ``exec_module`` runs through its watch's ``imported``; the module keeps ``loader`` itself."""

    def __init__(self, loader: Any, watch: _ImportWatch) -> None:
        self.loader, self.watch = loader, watch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.watch.stop()
        self.watch.imported(lambda: self.loader.exec_module(module))

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.loader, attribute)


@contextmanager
def peft_adapters_outside_zero_init() -> Iterator[None]:
    """While active, PEFT creates its adapters as ordinary tensors even inside ``deepspeed.zero.Init``, whose
    0-element placeholders would make PEFT's initialisation a no-op (LoRA B random); the strategy partitions them at
    setup."""
    stack = ExitStack()  # entered and closed once per outermost PEFT call
    with peft_adapters.around_adapter_creation(
        enter=lambda: stack.enter_context(outside_zero_init()), leave=stack.close
    ):
        yield


@contextmanager
def zero3_pretrained_loading(config: dict, plan: Optional[LoadPlan] = None) -> Iterator[None]:
    """While active, ``PreTrainedModel.from_pretrained`` builds ZeRO-3 params for the DeepSpeed ``config`` and each
    rank loads its own slices, stored and recorded as ``plan`` says (default: the compute dtype, recorded nowhere).
    Without transformers this does nothing."""
    plan = plan or LoadPlan(LoadedBase())

    def adopt(frozen_dtype: str) -> None:
        plan.frozen_dtype, plan.bitsandbytes = frozen_dtype, True

    def building_quantized() -> bool:  # read as each param is built: a quantization_config may have set it
        return plan.frozen_dtype is not None and transformers_loading.building_model()

    compute = compute_dtype(config) or torch.float32
    with (
        qlora.adopted_as_frozen_dtype(lambda: plan.frozen_dtype, adopt, compute),
        transformers_loading.zero3_loading(
            config, _shapes_only, functools.partial(_load_own_slices, plan), compute
        ) as patched,
        placeholders.untouched_while_loading(building_quantized, enabled=patched),
        placeholders.not_broadcast_while_loading(transformers_loading.building_model, enabled=patched),
    ):
        yield


def _shapes_only(original: Callable[..., dict], checkpoint_file: Any, *args: Any, **kwargs: Any) -> dict:
    """A safetensors file's tensors as meta tensors that remember the file; other formats, and a file holding a dtype
    torch lacks, load as transformers does."""
    path = os.fspath(checkpoint_file)
    header = slice_reads.read_header(path, every=True) if path.endswith(".safetensors") else None
    if header is None:
        return original(checkpoint_file, *args, **kwargs)
    shapes = {key: torch.empty(at.shape, dtype=at.dtype, device="meta") for key, at in sorted(header.items())}
    for tensor in shapes.values():
        setattr(tensor, _SOURCE, path)
    return shapes


def _load_own_slices(
    plan: LoadPlan,
    original: Callable[..., tuple[list[str], set[str]]],
    model_to_load: nn.Module,
    state_dict: dict[str, torch.Tensor],
    load_config: Any = None,
) -> tuple[list[str], set[str]]:
    """Copy (or encode, see :class:`LoadPlan`) each tensor's slice that this rank holds from its file, a tensor that
    transformers converts at load (a MoE layer's fused experts) from the parts of the folder's tensors it is built of;
    transformers' own path where that cannot work."""
    if plan.bitsandbytes and plan.frozen_dtype is not None:
        transformers_loading.mark_loaded_in_kbit(model_to_load, 4 if plan.frozen_dtype == "nf4" else 8)
    targets = model_to_load.state_dict(keep_vars=True)
    folder = None
    if all(hasattr(t, _SOURCE) for t in state_dict.values()):
        folder = conversions.loading_layout(model_to_load, list(state_dict), load_config)
    if folder is not None and folder.conversions and not available(CONVERTED_LOADING):
        folder = None
    errors: list[str] = []
    with outside_zero_init():  # its tensor constructors would make the checksum's, codec's and converter's tensors bf16
        index = None if folder is None else slice_reads.FolderIndex({getattr(t, _SOURCE) for t in state_dict.values()})
        items = None if index is None else _items(model_to_load, folder, targets, index, errors)
        if folder is not None and items is not None:
            if folder.conversions:  # as transformers' loader records them: `save_pretrained` reverts them
                conversions.record_conversions(model_to_load, folder.used)
            missing = set(targets) - set(folder.keys) - set(folder.conversions)  # as transformers counts them
            return _load_slices(plan, targets, items, index, errors, missing)
    rank_zero_info(
        "lightning-frozen: this checkpoint needs transformers' own ZeRO-3 loader (tensor conversions it cannot slice"
        " or a non-safetensors file): rank 0 reads each tensor and broadcasts it"
        + (
            f", and the frozen shards are stored as {plan.frozen_dtype} only at setup, so each node holds the base"
            " in the compute dtype until then."
            if plan.frozen_dtype
            else "."
        )
    )
    return original(model_to_load, _materialize_on_rank_zero(state_dict), load_config)


@dataclass(frozen=True)
class _Item:
    """One model tensor to load: where its values lie (``source``), and whether this rank takes its slice (a ZeRO-3
    param) or the whole tensor."""

    name: str
    source: slice_reads.TensorSource
    sliced: bool


def _items(
    model: nn.Module,
    folder: conversions.FolderLayout,
    targets: dict[str, torch.Tensor],
    index: slice_reads.FolderIndex,
    errors: list[str],
) -> Optional[list[_Item]]:
    """The tensors to load from the folder, in the order they lie in its files; a shape that differs from the model's
    is put in ``errors`` instead. None where a conversion is one this loader cannot slice: it builds other tensors than
    its one target (split across params), or transformers' converter fails on the folder's shapes."""
    try:
        where = conversions.locations(model, folder, {key: at.shape for key, (_, at) in index.tensors.items()})
    except conversions.ConversionError:  # transformers' own loader then, as before
        return None
    found = []
    for name, (shape, starts, build) in where.items():
        source = prequantized.packed_source(starts[0][0], index) if name in folder.keys else None
        found.append((name, source or index.source(shape, starts, build)))
    found.sort(key=lambda each: index.order(each[1].runs[0].key))
    items = []
    for name, source in found:
        target = targets[name]
        if source.shape != tuple(full_shape(target)):
            errors.append(
                f"size mismatch for {name}: copying a param with shape {source.shape} from checkpoint, the shape in"
                f" current model is {tuple(full_shape(target))}."
            )
            continue
        items.append(_Item(name, source, is_partitioned(target)))
    packed = [targets[i.name] for i in items if isinstance(i.source, prequantized.PackedNF4Source) and i.sliced]
    prequantized.say_cut_blocks([(full_numel(target), shard_numel(target)) for target in packed])
    return items


def _load_slices(
    plan: LoadPlan,
    targets: dict[str, torch.Tensor],
    items: list[_Item],
    index: slice_reads.FolderIndex,
    errors: list[str],
    missing: set[str],
) -> tuple[list[str], set[str]]:
    # only what is loaded counts: a folder may hold more than the model uses (a CLIP folder for its vision tower);
    # counted in the files' bytes, not the model's dtype (a bf16 file loaded under 32-true is half the fp32 bytes)
    parts = {item.name: _cache_part(plan, item, targets[item.name], index) for item in items}
    with code_cache.cached_load(
        plan.code_cache, list(parts.values()), plan.frozen_dtype, plan.fingerprint_mode
    ) as cache:
        if cache is not None and cache.hit:  # the folder's headers were read, none of its tensors
            cache.place_all(plan.loaded, {item.name: item.source for item in items})
            for item in items:
                transformers_loading.mark_initialized(targets[item.name])
            return errors, missing
        kept = None if cache is None else (lambda item: cache.keep(parts[item.name], plan.loaded))
        _read_and_store(plan, targets, items, index, kept)
        if cache is not None:
            cache.finish(plan.loaded)
    return errors, missing


def _cache_part(plan: LoadPlan, item: _Item, target: torch.Tensor, index: slice_reads.FolderIndex) -> code_cache.Part:
    # as `store_slice` encodes them; a pre-quantized weight's values are its codes dequantized
    floating = isinstance(item.source, prequantized.PackedNF4Source) or all(
        index.tensors[run.key][1].dtype.is_floating_point for run in item.source.runs
    )
    files = tuple(sorted({run.path for run in item.source.runs}))
    return code_cache.Part(item.name, target, item.sliced, files, plan.frozen_dtype if floating else None)


def _read_and_store(
    plan: LoadPlan,
    targets: dict[str, torch.Tensor],
    items: list[_Item],
    index: slice_reads.FolderIndex,
    kept: Optional[Callable[[_Item], None]] = None,
) -> None:
    """Read, store and record each item's slice (or whole tensor), one item ahead; ``kept(item)`` once it is stored
    (the code cache copies it into its file then)."""
    file_bytes = {item.name: sum(index.tensors[run.key][1].nbytes for run in item.source.runs) for item in items}
    progress = Progress(sum(file_bytes.values()))
    checksum, casts = Checksummer(KERNELS), CastBuffer()
    ranges = [shard_range(targets[item.name]) if item.sliced else (0, full_numel(targets[item.name])) for item in items]
    reads = [item.source.reads(*at) for item, at in zip(items, ranges)]
    with slice_reads.read_ahead(reads) as slices:
        for item, at in zip(items, ranges):
            target, values = targets[item.name], item.source.values(next(slices), *at)
            if item.sliced:
                store_slice(values, target, plan, checksum, item.source, casts)
            else:
                with torch.no_grad():
                    target.copy_(values.reshape(target.shape))
            transformers_loading.mark_initialized(target)
            if kept is not None:
                kept(item)
            if progress.advance(file_bytes[item.name]):
                rank_zero_info(f"lightning-frozen: loading the frozen base: {_load_status(progress)}")
    folder = os.path.dirname(next(iter(index.tensors.values()), ("",))[0])
    rank_zero_info(f"lightning-frozen: loaded {folder} into ZeRO-3 shards: {_load_status(progress)}")


class CastBuffer:
    """One buffer that slices are cast into before they are checksummed and encoded, reused from slice to slice (a
    fresh one's pages are zeroed by the kernel first: half of a 1.1B load); holds the largest slice until the load
    ends."""

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None

    def cast(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``values`` in ``dtype``: themselves, or a view of the buffer that the next call writes over."""
        if values.dtype == dtype:
            return values
        if self._buffer is None or self._buffer.dtype != dtype or self._buffer.numel() < values.numel():
            self._buffer = None  # let go of the smaller one first
            self._buffer = torch.empty(values.numel(), dtype=dtype)
        return self._buffer[: values.numel()].copy_(values)


def store_slice(
    values: torch.Tensor,
    target: torch.Tensor,
    plan: LoadPlan,
    checksum: Checksummer,
    source: slice_reads.TensorSource,
    casts: CastBuffer,
) -> None:
    """Put ``values`` (this rank's flat slice of the tensor whose values lie where ``source`` says, in the files'
    dtype) into ``target``'s ZeRO-3 shard: recorded in ``plan.loaded`` (with ``checksum``) and, with
    ``plan.frozen_dtype``, stored as codes (cast to the param's dtype in ``casts`` first)."""
    start, count = shard_range(target)
    shard = local_shard(target)
    frozen_dtype = plan.frozen_dtype if values.is_floating_point() else None
    with torch.no_grad():
        read = values
        if frozen_dtype is not None:
            values = casts.cast(values, shard.dtype)
        else:  # the copy casts; the values as the param holds them are its shard's
            values = shard.narrow(0, 0, count).copy_(values)
        sha256 = source_sha256(source, target.dtype) if plan.fingerprint_mode == "sha256" else None
        plan.loaded.record(target, values, start, checksum, sha256)
        if frozen_dtype is not None:
            # bf16 read into an fp32 shard: the cast is exact, so the codes of the values read are those of the
            # cast ones, from half the bytes (for `frozen_dtype="bf16"` a copy instead of a rounding cast back)
            exact = read.dtype == torch.bfloat16 and values.dtype == torch.float32
            store_codes(target, read if exact else values, frozen_dtype, KERNELS)
            plan.loaded.quantized(target, source)


def _materialize_on_rank_zero(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers' own ZeRO-3 loader expects: values on rank 0, shapes elsewhere."""
    keys = [key for key, tensor in state_dict.items() if hasattr(tensor, _SOURCE)] if _rank() == 0 else []
    values = dict(state_dict)
    whole = [slice_reads.SliceRead(getattr(state_dict[key], _SOURCE), key, 0, state_dict[key].numel()) for key in keys]
    with slice_reads.read_ahead(whole) as read:
        values.update({key: next(read).view(state_dict[key].shape) for key in keys})
    return values


def _rank() -> int:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_rank() if distributed else 0


def _load_status(progress: Progress) -> str:
    """The tensors and MiB loaded so far, out of how many MiB, in how long, how fast and how long still to go."""
    return f"{progress.items} tensors, {progress.status('MiB', 2**20)}"
