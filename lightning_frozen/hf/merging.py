"""What the merged export uses of transformers and PEFT, all in one place: the model a base folder holds built on the
meta device (no memory) with the adapter injected as PEFT injects it, one shape-only description of every part the
export writes (:func:`merged_parts`), and the merge of each part by PEFT's own ``merge``
of one tuner layer at a time (``merge`` / ``unload_and_optionally_merge_module``, the calls of PEFT's
``merge_and_unload`` loop), so that the arithmetic of every tuner stays PEFT's.

A base whose tensors transformers converts as it loads them (a MoE's experts, stored one by one in the folder and
fused into one tensor per layer; renamed legacy keys) goes through transformers' own conversion machinery both ways:
``hf/conversions.py`` groups the folder's keys as its loader does and finds where each lies in a model tensor, and
tensors are written back under the keys ``save_pretrained`` writes (its ``revert_weight_conversion``, with the
conversions the folder used recorded on the model once, as ``from_pretrained`` records them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.capabilities import CONVERTED_EXPORT, MERGE_CHECK, available, require
from lightning_frozen.errors import (
    BaseFolderError,
    CheckpointFormatError,
    UnsupportedConfigurationError,
    format_names,
)
from lightning_frozen.format.merged_parts import MergedParts, Part, Read, Written
from lightning_frozen.hf import conversions
from lightning_frozen.hf.peft_adapters import is_modules_to_save_wrapper

_PEFT_WAY = (
    "Merge it with PEFT itself: `export_peft_adapter`, then `PeftModel.from_pretrained(base, ...).merge_and_unload()`."
)
GENERATION_CONFIG_NAME = "generation_config.json"
# elements of a LoRA delta computed and added at a time (4 MiB in fp32): a block stays in the cache between the two
DELTA_BLOCK_ELEMENTS = 1 << 20
# the transformers class each PEFT task type wraps (PEFT's `AutoPeftModelFor*` classes)
TASK_MODEL_CLASSES = {
    "CAUSAL_LM": "AutoModelForCausalLM",
    "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM",
    "SEQ_CLS": "AutoModelForSequenceClassification",
    "TOKEN_CLS": "AutoModelForTokenClassification",
    "QUESTION_ANS": "AutoModelForQuestionAnswering",
    "FEATURE_EXTRACTION": "AutoModel",
}


def cached_snapshot(reference: str) -> Optional[Path]:
    """The folder of the hub model ``reference`` in the local Hugging Face cache (what ``from_pretrained`` downloaded),
    or None where it is not cached; nothing is downloaded."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(reference, local_files_only=True))
    except Exception:  # not a repository id, or not in the cache: the caller names the fix
        return None


def model_classes(config: Any, task_type: Optional[str], recorded: Optional[str] = None) -> list[Any]:
    """The class the checkpoint ``recorded`` (``module.QualName``) where transformers has it; else the classes a
    module may have built from a folder of ``config``, likeliest first: the one of the adapter's task type, those the
    folder names (``architectures``), the bare model."""
    import transformers

    module, _, name = (recorded or "").rpartition(".")
    if module.startswith("transformers.") and isinstance(getattr(transformers, name, None), type):
        return [getattr(transformers, name)]
    names = [TASK_MODEL_CLASSES[task_type]] if task_type in TASK_MODEL_CLASSES else []
    names += [name for name in getattr(config, "architectures", None) or [] if hasattr(transformers, name)]
    names.append("AutoModel")
    return [getattr(transformers, name) for name in dict.fromkeys(names)]


def _meta_model(model_class: Any, config: Any) -> nn.Module:
    """A model of ``model_class`` (a transformers class or Auto class) for ``config``, every tensor on the meta
    device, tied weights tied as ``from_pretrained`` ties them."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(model_class, "from_config"):  # an Auto class
            return model_class.from_config(config)
        return model_class(config)


def _with_adapters(model: nn.Module, peft_configs: Mapping[str, Mapping[str, Any]], adapter_name: str) -> Any:
    """``model`` (on the meta device) with the adapters of ``peft_configs`` (name -> adapter config as a plain dict,
    each run's adapters in order) injected as ``get_peft_model`` and ``add_adapter`` inject them, their tensors on the
    meta device too; ``adapter_name`` is the active one.

    Raises:
        ValueError: what PEFT raises for a config it cannot apply to ``model``.
    """
    from peft import PeftConfig, get_peft_model

    configs = {
        name: PeftConfig.from_peft_type(**{**config, "inference_mode": True}) for name, config in peft_configs.items()
    }
    first, *others = configs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, configs[first], adapter_name=first, low_cpu_mem_usage=True)
        for name in others:
            peft_model.add_adapter(name, configs[name], low_cpu_mem_usage=True)
        peft_model.set_adapter(adapter_name)
    return peft_model


def merged_parts(
    folder: Path,
    stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    dtype: Optional[torch.dtype],
    source: str,
    peft_configs: Mapping[str, Mapping[str, Any]],
    adapter_name: str,
    saved_class: Optional[str],
    expected: set[str],
    trained: list[str],
    state: Mapping[str, torch.Tensor],
) -> MergedParts:
    """The parts of the merged model of a checkpoint (``source``), shape only, as ``save_pretrained`` writes them: the
    model PEFT's ``merge_and_unload`` leaves of the run's adapted model, built once on the meta device from ``folder``
    (its tensors' dtype and shape by key: ``stored``) with the adapters of ``peft_configs`` (``adapter_name`` merged).
    The model is of the class the checkpoint recorded, or else of the folder's model classes the one whose tensors are
    the ``expected`` names; its ``trained`` tensors and its buffers come from ``state`` (by name in the PEFT model). Its
    tensors are in ``dtype``, else each in the dtype of the folder tensor it is read from, else the dtype most of those
    are in.

    Raises:
        CheckpointFormatError: no model class of the folder has the checkpoint's tensors.
        UnsupportedConfigurationError: PEFT needs the base's values to create the adapter's layers, or refuses to
            merge it; transformers cannot convert or revert the folder's tensors as its loader and ``save_pretrained``
            do.
        BaseFolderError: the merged model needs a tensor neither trained nor in the folder.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    differences = []
    task_type = peft_configs[adapter_name].get("task_type")
    for model_class in model_classes(config, task_type, saved_class):
        plain = _meta_model(model_class, config)
        # each tensor's names in the plain model (several where tied): PEFT's injection keeps the tensors
        names_of: dict[int, list[str]] = {}
        for name, tensor in [*plain.named_parameters(remove_duplicate=False), *plain.named_buffers()]:
            names_of.setdefault(id(tensor), []).append(name)
        layout = conversions.folder_layout(plain, list(stored))
        try:
            model = _with_adapters(plain, peft_configs, adapter_name)
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
        buffers = {name for name, _ in model.named_buffers()}
        if params <= expected <= params | buffers:
            values = {name: state[name] for name in trained}
            values |= {name: value for name, value in state.items() if name in buffers}
            model.load_state_dict(values, strict=False, assign=True)
            reason = _unmergeable(model)
            if reason:
                raise UnsupportedConfigurationError(
                    f"{source}: its {peft_configs[adapter_name].get('peft_type')} adapter cannot be merged into the"
                    f" base ({reason}). Export it with `lightning_frozen.export_peft_adapter` and serve it as an"
                    " adapter."
                )
            return _Description(model, config, adapter_name, names_of, layout, stored, dtype).parts()
        differences.append(
            f"{model_class.__name__}: lacks {format_names(sorted(expected - params - buffers))}, has"
            f" {format_names(sorted(params - expected))}"
        )
    raise CheckpointFormatError(
        f"{source}: no model class of {folder} holds the tensors the checkpoint was trained with"
        f" ({'; '.join(differences)}). Was the module built from this folder with another class or other"
        " `from_pretrained` arguments?"
    )


class _Description:
    """:func:`merged_parts` of the adapted ``model`` (the PEFT model a run trained, on the meta device, with the
    checkpoint's tensors of it in place), walking it once: the base folder's ``config``, the active ``adapter``, each
    tensor's names in the model without the adapter (``names_of``), where those names come from in the folder."""

    def __init__(
        self,
        model: Any,
        config: Any,
        adapter: str,
        names_of: dict[int, list[str]],
        layout: conversions.FolderLayout,
        stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        dtype: Optional[torch.dtype],
    ) -> None:
        self.inner, self.config, self.adapter = model.base_model.model, config, adapter
        self.names_of, self.layout, self.stored, self.wanted = names_of, layout, stored, dtype
        if layout.used:  # its keys are written back as save_pretrained reverts them
            require(CONVERTED_EXPORT)
            conversions.record_conversions(self.inner, layout.used)  # as `from_pretrained` does: what it reverts
        try:  # where each tensor lies in the folder's: each conversion's one dry run
            self.where = conversions.locations(
                self.inner, layout, {k: s for k, (_, s) in stored.items()}, self.reverted
            )
        except conversions.ConversionError as error:
            raise self.refused(str(error)) from error
        floats = [
            stored[k][0] for _, starts, _ in self.where.values() for k, _ in starts if stored[k][0].is_floating_point
        ]
        self.dtype = dtype or max(set(floats), key=floats.count, default=torch.float32)
        self.names: dict[int, tuple[str, ...]] = {}  # each tensor's names in the PEFT model: its fingerprint record's
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            self.names[id(tensor)] = (*self.names.get(id(tensor), ()), name)

    def parts(self) -> MergedParts:
        named: list[tuple[Optional[str], Part]] = []
        changed: set[str] = set()
        for name, module, is_unit in _merge_units(self.inner):
            lead = f"{name}." if name else ""
            if is_unit:
                named.append((None, self.unit(lead, module, changed)))
                continue
            own = [(f"{lead}{k}", t) for k, t in module.state_dict(keep_vars=True).items() if "." not in k]
            named += [(k, self.tensor(k, t)) for k, t in own]
        tied = [names for names in self.names_of.values() if len(names) > 1]
        # of weights tied in the base that no adapter changed, only the first name is written (as save_pretrained
        # writes them); from_pretrained ties them again
        dropped = {n for names in tied if not any(n in changed for n in names) for n in names[1:]}
        untied = sorted({n for names in tied if any(x in changed for x in names) for n in names})
        parts = [part for name, part in named if name not in dropped]
        return MergedParts(parts, untied, functools.partial(_write_config, self.inner, self.config, self.dtype, untied))

    def refused(self, what: str) -> UnsupportedConfigurationError:
        model_type = getattr(self.config, "model_type", type(self.inner).__name__)
        return UnsupportedConfigurationError(
            f"transformers converts the tensors of this {model_type!r} base as it loads them, and {what}, so the"
            f" merged export cannot write it as `save_pretrained` does. {_PEFT_WAY}"
        )

    def reverted(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (by model key) under the keys and in the layout ``save_pretrained`` writes them: transformers'
        ``revert_weight_conversion`` (on meta tensors it gives the keys and shapes alone).

        Raises:
            ValueError, NotImplementedError: transformers cannot revert a conversion.
        """
        if not self.layout.used:  # nothing was converted or renamed: written as named
            return dict(tensors)
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.inner, dict(tensors))

    def converted(self, tensor: torch.Tensor) -> bool:
        return any(n in self.layout.conversions for n in self.names_of.get(id(tensor), []))

    def dtype_of(self, key: Optional[str], fallback: torch.dtype) -> torch.dtype:
        own = self.stored[key][0] if key is not None else fallback
        if not own.is_floating_point:
            return own
        return self.wanted or (own if key is not None else self.dtype)

    def read(self, tensor: torch.Tensor) -> Optional[Read]:
        """Where a meta tensor of the model is read from in the folder (its own key, or the keys it is converted
        from); None where it is not there."""
        name = next((n for n in self.names_of.get(id(tensor), []) if n in self.where), None)
        if name is None:
            return None
        _, starts, build = self.where[name]
        dtype = self.dtype_of(starts[0][0], tensor.dtype)
        return Read(self.names.get(id(tensor), ()), dtype, tuple(tensor.shape), tuple(starts), build)

    def written(self, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> list[Written]:
        """``tensors`` (by model name) as ``save_pretrained`` writes them: transformers' revert, on meta tensors.

        Raises:
            UnsupportedConfigurationError: transformers cannot revert a conversion of them.
        """
        meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape) in tensors.items()}
        try:
            written = self.reverted(meta)
        except Exception as error:  # a conversion without a reverse op raises whatever its op raises
            raise self.refused(
                f"cannot revert it for {format_names(list(meta))} ({type(error).__name__}: {error})"
            ) from error
        return [Written(name, value.dtype, tuple(value.shape)) for name, value in written.items()]

    def tensor(self, name: str, tensor: torch.Tensor) -> Part:
        """A tensor of a plain module: trained, copied through, or converted (whole, or by expert)."""
        if not tensor.is_meta:
            value = tensor.detach()
            written = self.written({name: (self.dtype_of(None, value.dtype), tuple(value.shape))})
            return Part(written, [], lambda _: self.reverted({name: value}))
        read = self.read(tensor)
        if read is None:
            raise BaseFolderError(
                f"The merged model needs `{name}`, which is neither in the base folder nor trained. Pass the folder the"
                " run loaded its base from as `base=` (`--base` on the command line)."
            )
        written = self.written({name: (read.dtype, read.shape)})
        if not self.converted(tensor):
            return Part(written, [read])
        by_expert = self.by_expert([read], [tensor], written)
        if by_expert is not None:
            return Part(by_expert, [read])
        return Part(written, [read], lambda values: self.reverted({name: values[0]}))

    def unit(self, lead: str, unit: nn.Module, changed: set[str]) -> Part:
        """A tuner layer or wrapper: its meta tensors read, what PEFT puts in its place written."""
        reads, targets, missing = [], [], []
        for module_name, module in _merge_inputs(unit):
            for attr, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if not tensor.is_meta:
                    continue
                read = self.read(tensor)
                if read is None:  # state PEFT computes when it creates the layer
                    missing.append(".".join(part for part in (lead[:-1], module_name, attr) if part))
                    continue
                reads.append(read)
                targets.append((module, attr, tensor))
        base = {}
        for k, t in _merged_module(unit, None).state_dict(keep_vars=True).items():
            read = self.read(t)
            base[f"{lead}{k}"] = (read.dtype if read else self.dtype_of(None, t.dtype), tuple(t.shape))
        changed.update(base)
        written = self.written(base)
        # PEFT's ParamWrappers alone (nested), each adapting one converted tensor: merged by expert
        wrappers = [m for m in unit.modules() if hasattr(m, "get_delta_factors") and hasattr(m, "parameter_name")]
        adapting = {(id(m.get_base_layer()), m.parameter_name): m for m in wrappers}
        if hasattr(unit, "get_delta_factors") and not missing and all((id(m), a) in adapting for m, a, _ in targets):
            adapter = self.adapter
            with_delta = [
                dataclasses.replace(read, delta=_expert_delta(adapting[id(m), attr], adapter))
                for read, (m, attr, _) in zip(reads, targets)
            ]
            by_expert = self.by_expert(with_delta, [t for _, _, t in targets], written)
            if by_expert is not None:
                return Part(by_expert, with_delta)
        merge = functools.partial(self.merged, lead, unit, targets, missing, list(base))
        return Part(written, reads, merge)

    def by_expert(
        self, reads: list[Read], tensors: list[torch.Tensor], written: list[Written]
    ) -> Optional[list[Written]]:
        """The folder tensors written for ``reads`` (of ``tensors``) one expert at a time: where each is a converted
        tensor whose experts lie stacked, and transformers' reversal writes each back as the folder stores it; else
        None."""
        if any(read.build is not None or not self.converted(t) for read, t in zip(reads, tensors)):
            return None
        found = [
            Written(key, self.dtype_of(key, read.dtype), self.stored[key][1])
            for read in reads
            for key, _ in read.starts
        ]
        return found if {(t.name, t.shape) for t in found} == {(t.name, t.shape) for t in written} else None

    def merged(
        self,
        lead: str,
        unit: nn.Module,
        targets: list[tuple[nn.Module, str, torch.Tensor]],
        missing: list[str],
        names: list[str],
        values: list[torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """A unit merged: its base tensors ``values`` put in, PEFT's merge, what PEFT puts in its place reverted as
        ``save_pretrained`` writes it; the base tensors are then freed (the meta ones put back).

        Raises:
            UnsupportedConfigurationError: the merge needs tensors PEFT computes when it creates the layer.
        """
        for (module, attr, tensor), value in zip(targets, values):
            _put(module, attr, value.reshape(tensor.shape))
        try:
            merged = _merged_module(unit, self.adapter).state_dict()
        except (RuntimeError, NotImplementedError):
            if not missing:
                raise
            merged = {"": torch.empty(0, device="meta")}  # refused below, naming what the layer lacks
        if any(value.is_meta for value in merged.values()):
            raise UnsupportedConfigurationError(
                f"The adapter's layer `{lead[:-1]}` needs {format_names(missing)}, in neither the checkpoint nor the"
                " base folder (PEFT computes it when it creates the layer), so the merged export cannot merge this"
                f" tuner. {_PEFT_WAY}"
            )
        found = {name: merged[name[len(lead) :]] for name in names}
        for module, attr, tensor in targets:  # freed; the adapter's tensors stay (views of the checkpoint file)
            _put(module, attr, tensor)
        return self.reverted(found)


def _put(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    """``value`` as ``module``'s own tensor ``attr``, a parameter where that is one."""
    is_param = attr in dict(module.named_parameters(recurse=False))
    if is_param and not isinstance(value, nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
    setattr(module, attr, value)


def _unmergeable(peft_model: Any) -> Optional[str]:
    """Why PEFT refuses to merge ``peft_model``'s adapter (its tuner's ``_check_merge_allowed``: a GPTQ base, LoRA's
    replicated layers), or None; prompt learning has no tuner layers to merge."""
    if peft_model.peft_config[peft_model.active_adapter].is_prompt_learning:
        return "PEFT's prompt learning adds virtual tokens to the input; it has no weights to fold into the base"
    if not available(MERGE_CHECK):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns of tied target modules, which the export unties
            peft_model.base_model._check_merge_allowed()
    except ValueError as error:
        return str(error)
    return None


def _merge_units(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """``(name, module, is_unit)`` for the modules of ``model`` (the inner model of an adapted one) that PEFT's
    ``merge_and_unload`` visits: tuner layers and auxiliary wrappers (``modules_to_save``, trainable tokens) are units,
    whose insides are not visited; every other module holds its own tensors only."""
    units: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{unit}.") for unit in units):
            continue
        is_unit = hasattr(module, "unload_and_optionally_merge_module") or hasattr(module, "base_layer")
        if is_unit:
            units.append(name)
        yield name, module, is_unit


def _merge_inputs(unit: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules of ``unit`` (named within it) whose tensors its merge reads: all of them, but the original a
    ``modules_to_save`` wrapper replaces by its trained copy."""
    skipped = is_modules_to_save_wrapper(unit)
    for name, module in unit.named_modules():
        if not (skipped and (name == "original_module" or name.startswith("original_module."))):
            yield name, module


def _merged_module(unit: nn.Module, adapter_name: Optional[str]) -> nn.Module:
    """What ``merge_and_unload`` puts in place of ``unit``: its base layer with the adapter merged in by PEFT's own
    ``merge`` (of the tuner layer, or through the wrapper's ``unload_and_optionally_merge_module``), or, for a plain
    LoRA ``Linear``, by :func:`_merge_lora_by_rows`, its arithmetic bit for bit; with no ``adapter_name``, unmerged
    (its names and shapes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(unit, "unload_and_optionally_merge_module"):
            names = None if adapter_name is None else [adapter_name]
            return unit.unload_and_optionally_merge_module(merge=bool(names), safe_merge=False, adapter_names=names)
        if adapter_name is not None and not _merge_lora_by_rows(unit, adapter_name):
            unit.merge(safe_merge=False, adapter_names=[adapter_name])
        return unit.get_base_layer()


def _merge_lora_by_rows(unit: nn.Module, adapter_name: str) -> bool:
    """PEFT's ``merge`` of a plain LoRA ``Linear`` (no variant, no LoRA bias, not fan-in-fan-out, fp32 factors), a block
    of rows at a time: ``B @ A * scaling`` in fp32 added to the weight and rounded once, as PEFT's in-place add does,
    without its two fp32 temporaries of the layer's size (a block stays in the cache: about 4x less CPU time on a
    2048x5632 layer). Returns False, merging nothing, for any other layer."""
    from peft.tuners.lora import Linear

    read = ("lora_A", "lora_B", "scaling", "lora_variant", "lora_bias", "fan_in_fan_out", "merged_adapters")
    if type(unit) is not Linear or not all(hasattr(unit, name) for name in read):  # another PEFT: its own merge
        return False
    if adapter_name not in unit.lora_A or adapter_name in unit.merged_adapters:
        return False
    a, b, weight = unit.lora_A[adapter_name].weight, unit.lora_B[adapter_name].weight, unit.get_base_layer().weight
    plain = adapter_name not in unit.lora_variant and not unit.lora_bias.get(adapter_name) and not unit.fan_in_fan_out
    if not plain or a.dtype != torch.float32 or b.dtype != torch.float32 or weight.dim() != 2:
        return False
    rows, columns = weight.shape
    step = max(1, DELTA_BLOCK_ELEMENTS // max(1, columns))
    block = torch.empty(min(step, rows), columns)
    with torch.no_grad():
        for first in range(0, rows, step):
            delta = block[: min(step, rows - first)]
            torch.mm(b[first : first + step], a, out=delta)
            part = weight[first : first + step]
            part.copy_(delta.mul_(unit.scaling[adapter_name]).add_(part))  # fp32 + the weight, as PEFT's `+=` adds
    unit.merged_adapters.append(adapter_name)
    return True


def _expert_delta(wrapper: nn.Module, adapter_name: str) -> Optional[Any]:
    """A function of ``(start, count)`` giving those flat elements, within one expert, of PEFT's delta of the param
    that ``wrapper`` (PEFT's ``ParamWrapper``) adapts: ``scaling * lhs @ rhs`` of its ``get_delta_factors`` for that
    expert alone, in the adapter's dtype; None where the wrapper holds no ``adapter_name``."""
    if adapter_name not in wrapper.lora_A:
        return None
    base, name = wrapper.get_base_layer(), wrapper.parameter_name
    own = getattr(base, name)
    exact = torch.empty(own.shape, dtype=wrapper.lora_A[adapter_name].weight.dtype, device="meta")
    setattr(base, name, nn.Parameter(exact, requires_grad=False))  # PEFT casts the factors to the param's dtype
    try:
        lhs, rhs, scaling = wrapper.get_delta_factors(adapter_name)
    finally:
        setattr(base, name, own)
    size = math.prod(own.shape[1:])

    def delta(start: int, count: int) -> torch.Tensor:
        expert, begin = divmod(start, size)
        return ((lhs[expert] @ rhs[expert]) * scaling).reshape(-1)[begin : begin + count]

    return delta


def shard_bytes(size: Any) -> int:
    """``max_shard_size`` (``"5GB"``, ``"500MB"``, bytes) in bytes, read as ``save_pretrained`` reads it.

    Raises:
        ValueError: not a size.
    """
    from transformers.utils.hub import convert_file_size_to_int

    return int(convert_file_size_to_int(size))


def _write_config(model: Any, config: Any, dtype: torch.dtype, untied: list[str], folder: Path) -> None:
    """Write the base folder's config as the merged folder's ``config.json``: the class of the model, the dtype of its
    weights, word embeddings untied where the adapter changed one side; and, for a model that generates and a base
    folder without one, the ``generation_config.json`` that ``save_pretrained`` writes."""
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    if untied:
        config.tie_word_embeddings = False
    config.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate() and not (folder / GENERATION_CONFIG_NAME).exists():
        generation.save_pretrained(str(folder))
