"""The models inside a module whose ``generate`` runs one forward per new token: transformers' ``GenerationMixin``."""

from __future__ import annotations

import sys

from torch import nn


def generating_models(module: nn.Module) -> list[nn.Module]:
    """The outermost transformers models inside ``module`` that can ``generate`` (instances of ``GenerationMixin``),
    in module order: a PEFT model's base model, a teacher beside it. Empty while transformers' generation module is
    not imported: nothing can be one, and a plain torch model's run imports none of transformers."""
    generation = sys.modules.get("transformers.generation.utils")
    if generation is None:
        return []
    GenerationMixin = generation.GenerationMixin  # noqa: N806  (the class, as transformers names it)

    found: list[nn.Module] = []
    inside: set[int] = set()
    for submodule in module.modules():
        if id(submodule) in inside or not isinstance(submodule, GenerationMixin):
            continue
        found.append(submodule)
        inside.update(id(child) for child in submodule.modules())
    return found
