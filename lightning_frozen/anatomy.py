"""The anatomy of a module, as the package reads it: its PEFT model, each adapter's params, what trains, the trained
copies that stand in for frozen originals (PEFT's ``modules_to_save``) and the frozen bases' references.

As torchtune finds a model's adapter params once (``get_adapter_params``), the strategy finds these once per setup
(:func:`anatomy_of`), and again when what trains changes (progressive unfreezing, a rebuild after a checkpoint's
groups), and keeps them in one :class:`Anatomy`: saving, export entries, per-adapter clipping and verifying the base
read it instead of each walking the module. Functions that are given only a module build one themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_frozen.base.fingerprint import trained_copy_originals
from lightning_frozen.hf import peft_adapters
from lightning_frozen.hf.reference import add_base_reference, chosen_reference, find_peft_model


@dataclass(frozen=True)
class Anatomy:
    """What a module is made of, found by :func:`anatomy_of`; stale once params are frozen or unfrozen."""

    peft: Optional[tuple[str, Any]]  # the first PEFT model inside the module, as (its name, ``""``: the module; it)
    adapter_params: Mapping[str, list[str]]  # each adapter's params by name (:func:`adapter_param_names`)
    trainable: tuple[str, ...]  # the names of the params that train, in the module's order
    trained_adapters: tuple[str, ...]  # the adapters with params that train, in the order of the PEFT config
    trained_copies: frozenset[str]  # params the adapted model does not compute with (``replaced_by_trained_copies``)
    base_references: Mapping[str, str]  # each frozen base's reference by module path (``find_base_references``)
    base_reference: Optional[str]  # the one checkpoints record (``find_base_reference``)


def anatomy_of(module: nn.Module, explicit_reference: Optional[str] = None) -> Anatomy:
    """Walk ``module``'s modules once for every part of its :class:`Anatomy`; ``explicit_reference`` (the strategy's
    ``frozen_base``) is its base reference when given."""
    params = dict(module.named_parameters())
    peft: Optional[tuple[str, Any]] = None
    layer_params: dict[str, list[str]] = {}
    copies: list[str] = []
    bases: dict[str, str] = {}
    for name, submodule in module.named_modules():
        if peft is None and peft_adapters.is_peft_model(submodule):
            peft = (name, submodule)
        peft_adapters.add_tuner_layer_params(layer_params, name, submodule)
        copies += trained_copy_originals(name, submodule)
        add_base_reference(bases, name, submodule)
    owned = _adapters_of(peft, layer_params)
    return Anatomy(
        peft=peft,
        adapter_params=owned,
        trainable=tuple(name for name, param in params.items() if param.requires_grad),
        trained_adapters=tuple(_trained(owned, params)),
        trained_copies=frozenset(copies),
        base_references=bases,
        base_reference=chosen_reference(explicit_reference, bases, peft, module),
    )


def adapter_param_names(module: nn.Module) -> dict[str, list[str]]:
    """Each adapter's params, by their names in ``module``, for every adapter of the PEFT model inside it (in the
    order of its ``peft_config``); empty without a PEFT model."""
    return _adapter_param_names(module, find_peft_model(module))


def trained_adapters(module: nn.Module) -> list[str]:
    """The adapters of ``module``'s PEFT model that have trainable params, in the order of its ``peft_config``."""
    return _trained(adapter_param_names(module), dict(module.named_parameters()))


def _adapter_param_names(module: nn.Module, peft: Optional[tuple[str, Any]]) -> dict[str, list[str]]:
    return _adapters_of(peft, peft_adapters.tuner_layer_params(module) if peft is not None else {})


def _adapters_of(peft: Optional[tuple[str, Any]], layer_params: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """Every adapter of the PEFT model, in the order of its ``peft_config``, with its tuner layers' params."""
    if peft is None:
        return {}
    owned: dict[str, list[str]] = {name: [] for name in peft[1].peft_config}
    for adapter, names in layer_params.items():
        owned.setdefault(adapter, []).extend(names)
    return owned


def _trained(owned: Mapping[str, list[str]], params: Mapping[str, nn.Parameter]) -> list[str]:
    return [adapter for adapter, names in owned.items() if any(params[name].requires_grad for name in names)]
