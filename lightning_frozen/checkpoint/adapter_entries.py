"""Adapters trained at once (``adapters.py``) in the run's one checkpoint, and one of them taken out alone.

The file is the run's: every adapter's weights and optimizer state by name, so the whole run resumes on any world
size as any run does. Its ``frozen_base`` entry holds one export entry per adapter (``peft_adapters``: name -> the
entry ``peft_export.peft_entry`` writes for a lone adapter), so ``export_peft_adapter(..., adapter=name)``,
``load_adapter(..., adapter=name)`` and ``load_from_checkpoint(..., adapter=name)`` take one adapter alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_frozen.anatomy import Anatomy
from lightning_frozen.checkpoint.peft_export import peft_entry, peft_entry_of
from lightning_frozen.errors import AdapterSetupError, format_names
from lightning_frozen.format import layout


def peft_entries(anatomy: Anatomy, trainable_names: Sequence[str], buffer_names: Sequence[str]) -> dict[str, Any]:
    """The checkpoint's PEFT export entries of a module of that ``anatomy`` (holding a PEFT model), as keyword
    arguments of ``layout.new_frozen_base_entry``: ``peft`` for one trained adapter (or a tuner whose adapter params are
    not in tuner layers, prompt learning), ``peft_adapters`` (name -> entry) for several."""
    assert anatomy.peft is not None
    prefix, peft_model = anatomy.peft
    trained = anatomy.trained_adapters
    if len(trained) < 2:
        adapter = trained[0] if trained else None
        return dict(peft=peft_entry(prefix, peft_model, trainable_names, buffer_names, adapter_name=adapter))
    entries = {}
    for name in trained:
        own = set(anatomy.adapter_params[name])
        names = [n for n in trainable_names if n in own]
        entries[name] = peft_entry(prefix, peft_model, names, buffer_names, adapter_name=name)
    return dict(peft_adapters=entries)


def adapter_state(
    anatomy: Anatomy, checkpoint: Mapping[str, Any], adapter: str, source: str, module_name: str
) -> tuple[dict[str, Any], set[str]]:
    """Adapter ``adapter``'s tensors in the checkpoint's ``state_dict``, and the names of its params in the module of
    that ``anatomy`` (of class ``module_name``).

    Raises:
        CheckpointFormatError, InvalidArgumentValueError: as ``peft_export.peft_entry_of``.
        AdapterSetupError: the module holds no adapter of that name.
    """
    names = set(layout.adapter_tensor_names(peft_entry_of(layout.frozen_base_of(checkpoint), adapter, source)))
    owned = anatomy.adapter_params.get(adapter)
    if not owned:
        raise AdapterSetupError(
            f"{source}: adapter `{adapter}` is not in `{module_name}`, which holds"
            f" {format_names(list(anatomy.adapter_params))}. Build the module with an adapter of that name"
            f" (`get_peft_model(base, config, adapter_name='{adapter}')`)."
        )
    return {name: value for name, value in layout.state_dict_of(checkpoint).items() if name in names}, set(owned)


def use_adapter(anatomy: Anatomy, adapter: str) -> None:
    """Make ``adapter`` the one active adapter of the PEFT model of a module of that ``anatomy``, so a plain forward
    computes with it."""
    if anatomy.peft is not None:
        anatomy.peft[1].set_adapter(adapter)
