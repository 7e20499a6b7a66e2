"""What the merged export uses of transformers and PEFT, all in one place: the model a base folder holds built on the
meta device (no memory), the adapter injected into it as PEFT injects it, and PEFT's own merge of one tuner layer at
a time (``merge`` / ``unload_and_optionally_merge_module``, the calls of PEFT's ``merge_and_unload`` loop), so that the
arithmetic of every tuner stays PEFT's.

A base whose tensors transformers converts as it loads them (a MoE's experts, stored one by one in the folder and
fused into one tensor per layer; renamed legacy keys) goes through transformers' own conversion machinery both ways:
``hf/conversions.py`` groups the folder's keys as its loader does and builds a model tensor from them, and
:func:`reverted` writes tensors back under the keys ``save_pretrained`` writes (its ``revert_weight_conversion``,
with the conversions the folder used, as ``from_pretrained`` records them on the model).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.capabilities import MERGE_CHECK, available
from lightning_frozen.hf import conversions
from lightning_frozen.hf.peft_adapters import is_modules_to_save_wrapper

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


def folder_config(folder: Path) -> Any:
    """The ``PretrainedConfig`` of the base folder (its ``config.json``)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


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


def meta_model(model_class: Any, config: Any) -> nn.Module:
    """A model of ``model_class`` (a transformers class or Auto class) for ``config``, every tensor on the meta
    device, tied weights tied as ``from_pretrained`` ties them."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(model_class, "from_config"):  # an Auto class
            return model_class.from_config(config)
        return model_class(config)


def adapted(model: nn.Module, peft_configs: Mapping[str, Mapping[str, Any]], adapter_name: str) -> Any:
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


def unmergeable(peft_model: Any) -> Optional[str]:
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


def inner_model(peft_model: Any) -> nn.Module:
    """The transformers model inside ``peft_model``, holding the tuner layers."""
    return peft_model.base_model.model


def merge_units(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
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


def merge_inputs(unit: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules of ``unit`` (named within it) whose tensors its merge reads: all of them, but the original a
    ``modules_to_save`` wrapper replaces by its trained copy."""
    skipped = is_modules_to_save_wrapper(unit)
    for name, module in unit.named_modules():
        if not (skipped and (name == "original_module" or name.startswith("original_module."))):
            yield name, module


def merged_module(unit: nn.Module, adapter_name: str) -> nn.Module:
    """What ``merge_and_unload`` puts in place of ``unit``: its base layer with the adapter merged in by PEFT's own
    ``merge`` (of the tuner layer, or through the wrapper's ``unload_and_optionally_merge_module``), or, for a plain
    LoRA ``Linear``, by :func:`merge_lora_by_rows`, its arithmetic bit for bit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(unit, "unload_and_optionally_merge_module"):
            return unit.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=[adapter_name])
        if not merge_lora_by_rows(unit, adapter_name):
            unit.merge(safe_merge=False, adapter_names=[adapter_name])
        return unit.get_base_layer()


def merge_lora_by_rows(unit: nn.Module, adapter_name: str) -> bool:
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


def unloaded_module(unit: nn.Module) -> nn.Module:
    """What ``merge_and_unload`` puts in place of ``unit``, without merging (its names and shapes)."""
    if hasattr(unit, "unload_and_optionally_merge_module"):
        return unit.unload_and_optionally_merge_module(merge=False, safe_merge=False, adapter_names=None)
    return unit.get_base_layer()


def expert_delta(wrapper: nn.Module, adapter_name: str) -> Optional[Any]:
    """A function of an expert's index giving PEFT's delta of the param that ``wrapper`` (PEFT's ``ParamWrapper``)
    adapts, for that expert alone: ``scaling * lhs @ rhs`` of its ``get_delta_factors``, in the adapter's dtype; None
    where the wrapper holds no ``adapter_name``."""
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
    return lambda expert: (lhs[expert] @ rhs[expert]) * scaling


def reverted(model: nn.Module, used: list[Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (by model key) under the keys and in the layout ``save_pretrained`` writes them for a model loaded
    from the folder whose conversions were ``used``: transformers' ``revert_weight_conversion`` (on meta tensors it
    gives the keys and shapes alone).

    Raises:
        ValueError, NotImplementedError: transformers cannot revert a conversion.
    """
    if not used:  # nothing was converted or renamed: written as named
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    conversions.record_conversions(model, used)  # as `from_pretrained` records them: `save_pretrained` reverts these
    return revert_weight_conversion(model, dict(tensors))


def shard_bytes(size: Any) -> int:
    """``max_shard_size`` (``"5GB"``, ``"500MB"``, bytes) in bytes, read as ``save_pretrained`` reads it.

    Raises:
        ValueError: not a size.
    """
    from transformers.utils.hub import convert_file_size_to_int

    return int(convert_file_size_to_int(size))


def written_config(model: nn.Module, config: Any, folder: Path, dtype: torch.dtype, untied: bool) -> None:
    """Write ``config`` as the merged folder's ``config.json``: the class of ``model`` (the inner model of an adapted
    one), the dtype of its weights, word embeddings untied where the adapter changed one side; and, for a model that
    generates and a base folder without one, the ``generation_config.json`` that ``save_pretrained`` writes."""
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    if untied:
        config.tie_word_embeddings = False
    config.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate() and not (folder / GENERATION_CONFIG_NAME).exists():
        generation.save_pretrained(str(folder))
