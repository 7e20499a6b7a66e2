"""A training forward of several adapters must say which rows each adapter is for (``adapters.py``).

PEFT adds every active adapter to every row, so two adapters trained on the same rows get coupled gradients: each
one's output, and so its gradient, depends on the others'. That is right only when meant (stacked adapters). This
module keeps which PEFT models are inside ``adapter_rows`` or ``shared_rows`` now, and puts on the LoRA layers a
forward pre-hook that refuses a forward with gradients outside both. The hook costs one lookup per LoRA layer call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_frozen.errors import AdapterSetupError, format_names
from lightning_frozen.hf import peft_adapters

# the PEFT models inside `adapter_rows` or `shared_rows` now, by id, with how many such contexts are open
_ROWS_GIVEN: Counter[int] = Counter()


@contextmanager
def rows_given(peft_model: Any) -> Iterator[None]:
    """Within the context, ``peft_model``'s forwards say which rows each adapter is for (or that all share them)."""
    _ROWS_GIVEN[id(peft_model)] += 1
    try:
        yield
    finally:
        _ROWS_GIVEN[id(peft_model)] -= 1
        if not _ROWS_GIVEN[id(peft_model)]:
            del _ROWS_GIVEN[id(peft_model)]


def guard(peft_model: Any, trained: frozenset[str], hooks: ExitStack) -> None:
    """A forward pre-hook on each LoRA layer of ``peft_model`` holding two or more of the ``trained`` adapters, put
    into ``hooks`` (closing it removes them): a forward with gradients enabled outside :func:`rows_given` that would
    add two or more of them to every row raises :class:`AdapterSetupError`."""
    for layer, held in peft_adapters.lora_layers(peft_model):
        if len(held & trained) >= 2:
            hooks.enter_context(layer.register_forward_pre_hook(partial(_refuse, id(peft_model), held & trained)))


def _refuse(key: int, trained: frozenset[str], layer: nn.Module, args: Any) -> None:
    if key in _ROWS_GIVEN or not torch.is_grad_enabled():
        return
    added = peft_adapters.adds_adapters(layer, trained)
    if len(added) >= 2:
        raise AdapterSetupError(
            f"A training forward adds adapters {format_names(added)} to every row, outside"
            " `lightning_frozen.adapters.adapter_rows`: each adapter's output and gradient would depend on the"
            " others', so they would not train as they would alone. Give each adapter its own rows: `batch, rows ="
            " multi.sweep_batch(batch, names)` and `with multi.adapter_rows(model, rows): ...`. To train them stacked"
            " on the same rows on purpose, run the forward inside `with lightning_frozen.adapters.shared_rows(model):`."
        )
