"""The frozen base's reference: where each frozen base inside a module came from (a hub id or folder), found from
PEFT's ``base_model_name_or_path`` or a Hugging Face ``config.name_or_path``, as checkpoints record it; and a base
built from its reference's config alone, on the meta device, for a memory estimate."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.errors import InvalidArgumentValueError
from lightning_frozen.hf import peft_adapters, transformers_loading


def find_base_reference(module: nn.Module, explicit: Optional[str] = None) -> Optional[str]:
    """Where the frozen base came from: ``explicit``, else that of the PEFT model, else the first of
    :func:`find_base_references`, else a ``frozen_base_reference`` attribute of ``module``; None if none is known."""
    if explicit:
        return str(explicit)
    return chosen_reference(None, find_base_references(module), find_peft_model(module), module)


def chosen_reference(
    explicit: Optional[str], bases: Mapping[str, str], peft: Optional[tuple[str, Any]], module: nn.Module
) -> Optional[str]:
    """:func:`find_base_reference` from what was found in ``module``: its ``bases`` (:func:`find_base_references`) and
    its ``peft`` model (:func:`find_peft_model`)."""
    if explicit:
        return str(explicit)
    reference = (bases.get(peft[0]) if peft else None) or next(iter(bases.values()), None)
    reference = reference or getattr(module, "frozen_base_reference", None)
    return str(reference) if reference else None


def find_base_references(module: nn.Module) -> dict[str, str]:
    """Each frozen base inside ``module`` by its module path: the outermost PEFT models (their
    ``base_model_name_or_path``) and Hugging Face models (``config.name_or_path``), e.g. ``{"vision": "org/clip",
    "language": "org/llama"}`` for a vision tower and a language model; empty when none names its source."""
    found: dict[str, str] = {}
    for name, submodule in module.named_modules():
        add_base_reference(found, name, submodule)
    return found


def add_base_reference(found: dict[str, str], name: str, submodule: nn.Module) -> None:
    """Add ``submodule``'s reference to ``found`` (:func:`find_base_references`, walking modules in order) if it names
    its source and is not inside a base ``found`` already holds."""
    if any(not outer or name.startswith(f"{outer}.") for outer in found):
        return  # inside a base already found
    peft_config, active = getattr(submodule, "peft_config", None), getattr(submodule, "active_adapter", None)
    adapter = peft_config.get(active) if isinstance(peft_config, dict) and isinstance(active, str) else None
    reference = getattr(adapter, "base_model_name_or_path", None)
    reference = reference or transformers_loading.loaded_from(submodule)
    if isinstance(reference, str) and reference:
        found[name] = reference


def base_of(tensor_name: str, bases: Mapping[str, str]) -> Optional[str]:
    """The reference of the base (of :func:`find_base_references`) that holds ``tensor_name``, or None."""
    owners = [path for path in bases if not path or tensor_name.startswith(f"{path}.")]
    return bases[max(owners, key=len)] if owners else None


def find_peft_model(module: nn.Module) -> Optional[tuple[str, Any]]:
    """The first ``peft.PeftModel`` inside ``module`` as ``(name, model)``; name is "" for the module itself."""
    for name, submodule in module.named_modules():
        if peft_adapters.is_peft_model(submodule):
            return name, submodule
    return None


def lora_model_on_meta(
    source: str, rank: int, target_modules: Optional[list[str]], target_parameters: Optional[list[str]] = None
) -> nn.Module:
    """The model a config.json describes (a folder holding one, the file, or a hub id), built on the meta device
    (nothing allocated, for a memory estimate), with LoRA of ``rank`` on ``target_modules`` (PEFT's choice for the
    model type where None) and on ``target_parameters`` (PEFT's, for a MoE's fused experts).

    Raises:
        InvalidArgumentValueError: PEFT finds nothing to adapt: no target modules of its own for the model type, or no
            parameter of the names given.
        OSError, ValueError: transformers cannot read the config at ``source``.
    """
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.from_pretrained(source)
    architecture = getattr(transformers, (config.architectures or [""])[0], None)
    with torch.device("meta"):
        model = architecture(config) if architecture else transformers.AutoModel.from_config(config)
    try:
        with warnings.catch_warnings():  # PEFT 0.21's get_peft_model reads a property transformers 5 deprecated
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            config = LoraConfig(r=rank, target_modules=target_modules, target_parameters=target_parameters)
            return get_peft_model(model, config)
    except ValueError as error:
        raise InvalidArgumentValueError(
            f"{source}: LoRA found nothing to adapt in `{type(model).__name__}` ({error}). Name modules with"
            " `--target-modules`, or parameters (a MoE's fused experts) with `--target-parameters`."
        ) from error
