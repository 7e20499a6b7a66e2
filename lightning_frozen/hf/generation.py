"""The models inside a module whose ``generate`` runs one forward per new token: transformers' ``GenerationMixin``."""

from __future__ import annotations

import importlib.util

from torch import nn


def generating_models(module: nn.Module) -> list[nn.Module]:
    """The outermost transformers models inside ``module`` that can ``generate`` (instances of ``GenerationMixin``),
    in module order: a PEFT model's base model, a teacher beside it. Empty without transformers installed."""
    if importlib.util.find_spec("transformers") is None:
        return []
    from transformers import GenerationMixin

    found: list[nn.Module] = []
    inside: set[int] = set()
    for submodule in module.modules():
        if id(submodule) in inside or not isinstance(submodule, GenerationMixin):
            continue
        found.append(submodule)
        inside.update(id(child) for child in submodule.modules())
    return found
