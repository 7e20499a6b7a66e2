"""transformers' conversion of a folder's tensors at load, as its own loader applies it, for the two places that read a
folder as ``from_pretrained`` would: the sliced loader (``base/pretrained.py``) and the merged export
(``checkpoint/merged_export.py``). A MoE folder stores each expert's tensors apart, and transformers fuses a layer's
experts into one tensor as it loads them (its conversion mapping, ``conversion_mapping`` and ``core_model_loading``);
legacy keys are renamed. :func:`folder_layout` groups a folder's keys as its loader does, :func:`converted` runs its
converter on given tensors, :func:`located` (the one dry run of a conversion) finds where each folder tensor lies in
a fused one, and :func:`record_conversions` records on a model the conversions its folder used, as
``from_pretrained`` does, so that ``save_pretrained`` reverts them.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.errors import format_names


@dataclass(frozen=True)
class Conversion:
    """A model tensor that transformers builds at load from folder tensors (a layer's experts fused into one): its
    converter (a fresh copy of transformers' ``WeightConverter``) and the folder keys it reads, by source pattern, in
    the order its loader collects them."""

    target: str
    converter: Any
    sources: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def keys(self) -> list[str]:
        return [key for _, keys in self.sources for key in keys]


@dataclass(frozen=True)
class FolderLayout:
    """How ``from_pretrained`` fills a model from a folder: ``keys`` ``{model key: folder key}`` for tensors read as
    they are (renamed or not), ``conversions`` ``{model key: Conversion}`` for those it converts, and the transforms
    the folder used (what ``from_pretrained`` records on the model and ``save_pretrained`` reverts)."""

    keys: dict[str, str]
    conversions: dict[str, Conversion]
    used: list[Any]


def folder_layout(model: nn.Module, keys: Sequence[str], mapping: Optional[Sequence[Any]] = None) -> FolderLayout:
    """The :class:`FolderLayout` of the folder's tensor ``keys`` for ``model`` (on the meta device, or built under
    ZeRO-3), grouped as transformers' loader groups them (``core_model_loading.convert_and_load_state_dict_in_model``):
    its conversion ``mapping`` (default: the model's), each key renamed and handed to at most one converter, keys in
    its natural order."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    if mapping is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        mapping = get_model_conversion_mapping(model)
    mapping = list(mapping)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    if converters:  # the converters' names are CONVERTED_LOADING's: a model without any reaches none of them
        from transformers.core_model_loading import dot_natural_key

        keys = sorted(keys, key=dot_natural_key)
    meta = {key: torch.empty(0, device="meta") for key in model.state_dict(keep_vars=True)}
    prefix = getattr(model, "base_model_prefix", None)
    plain: dict[str, str] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in keys:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # the loader's own fallback: the key as it is, prefixed if need be
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if renamed not in meta:
            continue
        if pattern is None:
            plain[renamed] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        groups.setdefault(renamed, (converter, {}))[1].setdefault(pattern, []).append(key)
    conversions = {
        target: Conversion(target, deepcopy(converter), tuple((p, tuple(k)) for p, k in sources.items()))
        for target, (converter, sources) in groups.items()
    }
    return FolderLayout(plain, conversions, [entry for entry in mapping if entry.was_used()])


def converted(model: nn.Module, conversion: Conversion, tensors: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model tensors ``conversion`` builds from ``tensors``, the values of its folder keys in order, by model key
    (transformers' own converter, as its loader calls it; it alone holds them)."""
    converter = deepcopy(conversion.converter)
    values = iter(tensors)
    for pattern, keys in conversion.sources:
        for key in keys:
            converter.add_tensor(conversion.target, key, pattern, next(values))
    built = converter.convert(conversion.target, model=model, config=model.config)
    return {key: value[0] if isinstance(value, list) else value for key, value in built.items()}


class ConversionError(ValueError):
    """transformers' converter cannot build a conversion's one model tensor from the folder's tensors; the message says
    why."""


def located(
    model: nn.Module,
    conversion: Conversion,
    shapes: Mapping[str, Sequence[int]],
    revert: Optional[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = None,
) -> tuple[tuple[int, ...], list[tuple[str, int]], Optional[Callable[[list[torch.Tensor]], torch.Tensor]]]:
    """Where the tensor ``conversion`` builds lies in the folder's tensors of ``shapes``: its shape, each folder key
    with the flat index it starts at in it, and None where those are the experts stacked (:func:`expert_runs`, with
    ``revert``), else the keys end to end and the function that builds the tensor from them (transformers' converter).

    Raises:
        ConversionError: the converter fails on tensors of these shapes (run on meta tensors), or builds more than its
            one target (a tensor split across params).
    """
    inputs = [torch.empty(tuple(shapes[key]), device="meta") for key in conversion.keys]
    try:
        built = converted(model, conversion, inputs)
    except Exception as error:  # whatever the converter raises, named
        raise ConversionError(
            f"its converter for `{conversion.target}` fails on the folder's tensors ({type(error).__name__}: {error})"
        ) from error
    if list(built) != [conversion.target]:
        raise ConversionError(f"it splits {format_names(conversion.keys)} into {format_names(list(built))}")
    shape = tuple(built[conversion.target].shape)
    runs = expert_runs(model, conversion, shapes, revert)
    if runs is not None:
        return shape, runs, None
    sizes = [math.prod(shapes[key]) for key in conversion.keys]
    held = weakref.ref(model)  # the record of the base keeps this function, not the model

    def build(tensors: list[torch.Tensor]) -> torch.Tensor:
        return converted(held(), conversion, tensors)[conversion.target]

    return shape, list(zip(conversion.keys, itertools.accumulate(sizes, initial=0))), build


def locations(
    model: nn.Module,
    layout: FolderLayout,
    shapes: Mapping[str, Sequence[int]],
    revert: Optional[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = None,
) -> dict[str, tuple[tuple[int, ...], list[tuple[str, int]], Optional[Callable[[list[torch.Tensor]], torch.Tensor]]]]:
    """Where each model tensor that ``layout`` fills lies in the folder's tensors of ``shapes``, by model key, as
    :func:`located` gives it (a tensor read as stored: its one key, from 0): for the sliced loader and the export.

    Raises:
        ConversionError: as :func:`located`.
    """
    found = {name: (tuple(shapes[key]), [(key, 0)], None) for name, key in layout.keys.items()}
    return found | {name: located(model, c, shapes, revert) for name, c in layout.conversions.items()}


def expert_runs(
    model: nn.Module,
    conversion: Conversion,
    shapes: Mapping[str, Sequence[int]],
    revert: Optional[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = None,
) -> Optional[list[tuple[str, int]]]:
    """Where transformers' converter puts each folder tensor of ``conversion`` when it stacks experts: expert by expert
    (the n-th key of every source pattern, as its loader collects them), its keys with the flat index each starts at in
    the converted tensor, in that order. Found by the converter itself, run on one expert's tensors numbered element by
    element; None where the converted tensor is not the experts stacked one after another, each folder tensor one run
    of it in its own order (the tensor is then converted whole), or where ``revert`` (``{model key: tensor}`` to
    ``{folder key: tensor}``, as ``save_pretrained`` reverts) does not give that expert's numbered tensors back."""
    counts = {len(keys) for _, keys in conversion.sources}
    if len(counts) != 1:
        return None
    experts = counts.pop()
    one = Conversion(conversion.target, conversion.converter, tuple((p, keys[:1]) for p, keys in conversion.sources))
    sizes = [math.prod(shapes[key]) for key in one.keys]
    size = sum(sizes)
    numbers = torch.arange(size, dtype=torch.float32 if size < 2**24 else torch.float64)  # exact in that dtype
    parts = [part.reshape(tuple(shapes[key])) for key, part in zip(one.keys, numbers.split(sizes))]
    try:
        built = converted(model, one, parts)[conversion.target]
    except Exception:  # a converter that needs every expert: converted whole
        return None
    flat = built.reshape(-1)
    if built.shape[0] != 1 or flat.numel() != size:
        return None
    starts = []
    for part in parts:
        start = int((flat == part.reshape(-1)[0]).nonzero()[0]) if part.numel() else 0
        if not torch.equal(flat[start : start + part.numel()], part.reshape(-1)):
            return None
        starts.append(start)
    if revert is not None:  # the numbered expert given back as the folder stores it: keys, shapes and values
        try:
            back = revert({conversion.target: built})
        except Exception:  # a reverse op that cannot take one expert: converted whole, reverted as save_pretrained does
            return None
        if back.keys() != set(one.keys) or not all(torch.equal(back[k], part) for k, part in zip(one.keys, parts)):
            return None
    order = sorted(range(len(starts)), key=starts.__getitem__)
    return [(conversion.sources[i][1][expert], expert * size + starts[i]) for expert in range(experts) for i in order]


def loading_layout(model: nn.Module, keys: Sequence[str], load_config: Any) -> Optional[FolderLayout]:
    """The :class:`FolderLayout` of the checkpoint ``keys`` for ``model`` under the conversion mapping that
    ``from_pretrained`` loads it with (``load_config.weight_mapping``: the model's, with a user's ``key_mapping``); None
    where that mapping holds a transform that is neither a renaming nor a converter, or transformers has no
    ``core_model_loading``."""
    try:
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return None
    mapping = list(getattr(load_config, "weight_mapping", None) or [])
    if not all(isinstance(entry, (WeightRenaming, WeightConverter)) for entry in mapping):
        return None
    return folder_layout(model, keys, mapping)


def record_conversions(model: nn.Module, used: list[Any]) -> None:
    """Record on ``model`` the conversions its folder ``used``, as ``from_pretrained`` records them: transformers'
    ``save_pretrained`` (``revert_weight_conversion``) reverts these."""
    model._weight_conversions = used
