"""A save whose trainable tensors reach the file one at a time, through the writing rank only.

Lightning builds a checkpoint's dict on every rank before the strategy writes it; here each trainable param's whole
value and each per-element optimizer state is a placeholder on the meta device (:class:`DeferredTensors`).
:func:`write` gathers them one after the other to the writing rank (``zero.params.gather_to_writer``), which puts
each value in the file and drops it before the next: a local file in two passes (``zero/torch_file.py``), a URL or a
``CheckpointIO`` plugin with the dict filled first.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.checkpoint import file
from lightning_frozen.zero import torch_file
from lightning_frozen.zero.params import gather_to_writer, optimizer_state_with, whole_on_meta


class DeferredTensors:
    """The trainable tensors of the save being built, as placeholders, and what each is gathered from. Every rank
    makes the same placeholders in the same order (the gathers are collective)."""

    def __init__(self) -> None:
        self.placeholders: list[torch.Tensor] = []
        self._sources: list[tuple[nn.Parameter, Any, Optional[str]]] = []
        self._gathered = 0

    def placeholder(
        self, param: nn.Parameter, deepspeed_optimizer: Any = None, key: Optional[str] = None
    ) -> torch.Tensor:
        """A meta tensor standing for ``param``'s whole value (its fp32 master copy when ``deepspeed_optimizer`` holds
        one), or with ``key`` its optimizer state ``key``, until :meth:`gather` gives it."""
        placeholder = whole_on_meta(param, deepspeed_optimizer, key)
        self.placeholders.append(placeholder)
        self._sources.append((param, deepspeed_optimizer, key))
        return placeholder

    def optimizer_state(self, deepspeed_optimizer: Any, param: nn.Parameter) -> dict[str, Any]:
        """``param``'s optimizer state by key: a placeholder for each per-element state, scalars (``step``) copied."""
        return optimizer_state_with(
            deepspeed_optimizer, param, lambda key: self.placeholder(param, deepspeed_optimizer, key)
        )

    def gather(self, put: Optional[torch_file.Put] = None) -> None:
        """Gather the placeholders not gathered yet, in order, each to the writing rank, which calls
        ``put(placeholder, value)`` with it (the other ranks get nothing). Collective."""
        while self._gathered < len(self._sources):
            index = self._gathered
            self._gathered += 1
            value = gather_to_writer(*self._sources[index])
            if put is not None and value is not None:
                put(self.placeholders[index], value)


def write(
    checkpoint: dict[str, Any],
    path: file.PathLike,
    deferred: DeferredTensors,
    writer: bool,
    checkpoint_io: Any = None,
    storage_options: Any = None,
) -> None:
    """Write ``checkpoint``, whose trainable tensors are ``deferred``'s placeholders, from the ``writer`` rank (a local
    path or URL, or through ``checkpoint_io``); the other ranks send their shards. Collective.

    A writer that fails still takes part in the gathers left, so that no other rank waits for it, then raises.
    """
    if not writer:
        deferred.gather()
        return
    try:
        if checkpoint_io is None and not file.is_url(path):
            file.write_in_two_passes(checkpoint, path, deferred.placeholders, deferred.gather)
        else:
            values: dict[int, torch.Tensor] = {}
            deferred.gather(lambda placeholder, value: values.__setitem__(id(placeholder), value))
            file.save(torch_file.with_values(checkpoint, values), path, checkpoint_io, storage_options)
    finally:
        deferred.gather()
