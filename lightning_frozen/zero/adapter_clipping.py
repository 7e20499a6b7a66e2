"""Gradient clipping per adapter in DeepSpeed's ZeRO-3 optimizer, for adapters trained at once (``adapters.py``).

DeepSpeed clips by one global norm over every param group, which couples adapters trained side by side: one
adapter's large gradient would shrink the others' steps. Here each adapter is clipped by the norm of its own
gradient, as if it trained alone: by the ``gradient_clip_val`` of its param groups where they have one (read at every
step), else by DeepSpeed's ``gradient_clipping`` (Lightning's ``gradient_clip_val``).

The contract bent, DeepSpeed 0.19's ``DeepSpeedZeroOptimizer_Stage3.step``: it takes one norm per sub-group from
``_get_norm_groups()`` (each already summed over every rank's partition, so over the whole tensor), combines them
with ``combine_grad_norm_groups`` and passes the result to ``unscale_and_clip_grads(sub_group_id, total_norm)`` for
every sub-group; ``sub_group_to_group_id`` maps a sub-group to its param group. Both methods are wrapped on the
optimizer instance: the first keeps the sub-group norms, the second gets the norm combined over the sub-groups of
the same adapter, and DeepSpeed's ``clip_grad`` holds the adapter's own value for that call. An overflow (fp16) in
one adapter still skips the step of every adapter: DeepSpeed decides it once, over all gradients, before any clipping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from lightning_frozen.errors import AdapterSetupError, format_names

# the param-group key that gives an adapter a clipping value of its own (``adapters.adapter_param_groups``)
GROUP_CLIP_KEY = "gradient_clip_val"


def check_group_clips(group_adapters: Sequence[Optional[str]], groups: Sequence[dict], trained: Sequence[str]) -> None:
    """Check the clipping values (:data:`GROUP_CLIP_KEY`) of the torch optimizer's param ``groups``, group ``i``
    training adapter ``group_adapters[i]`` (the list is empty when fewer than two adapters train).

    Raises:
        AdapterSetupError: a value that is not a number >= 0; an adapter whose groups give different values (it is
            clipped by one norm, so by one value); a value in a group while fewer than two adapters train.
    """
    if not group_adapters and any(group.get(GROUP_CLIP_KEY) is not None for group in groups):
        raise AdapterSetupError(
            f"`{GROUP_CLIP_KEY}` in a param group clips one adapter of several trained at once, and the module trains"
            f" fewer than two ({format_names(list(trained)) or 'none'}). Clip with `Trainer({GROUP_CLIP_KEY}=...)`."
        )
    values: dict[str, set[Optional[float]]] = {}
    for adapter, group in zip(group_adapters, groups):
        if adapter is None:
            continue
        value = group.get(GROUP_CLIP_KEY)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise AdapterSetupError(
                f"Adapter `{adapter}`'s `{GROUP_CLIP_KEY}` is {value!r}; give a number >= 0 (0: no clipping) or none."
            )
        values.setdefault(adapter, set()).add(value)
    for adapter, found in values.items():
        if len(found) > 1:
            shown = " and ".join(str(v) for v in sorted(found, key=lambda v: (v is None, v or 0)))
            raise AdapterSetupError(
                f"Adapter `{adapter}` has param groups with `{GROUP_CLIP_KEY}` {shown}: an adapter is clipped by the"
                " norm of all its gradients, so by one value. Give each of its groups the same value (or none, for"
                f" the Trainer's `{GROUP_CLIP_KEY}`)."
            )


def clip_per_adapter(zero_optimizer: Any, group_adapters: Sequence[Optional[str]]) -> None:
    """Make ``zero_optimizer`` clip each adapter's gradients by that adapter's own norm, at the ``gradient_clip_val``
    of its param groups or else DeepSpeed's ``gradient_clipping`` (group ``i`` trains ``group_adapters[i]``). Does
    nothing without any clipping value or with fewer than two adapters."""
    groups = getattr(getattr(zero_optimizer, "optimizer", None), "param_groups", [])
    clips = [getattr(zero_optimizer, "clip_grad", 0)] + [group.get(GROUP_CLIP_KEY) for group in groups]
    if len(set(group_adapters) - {None}) < 2 or not any(clips):
        return
    from deepspeed.runtime.utils import combine_grad_norm_groups

    norm_groups, clip = zero_optimizer._get_norm_groups, zero_optimizer.unscale_and_clip_grads
    default_clip = zero_optimizer.clip_grad
    adapter_norms: dict[str, Any] = {}

    def adapter_of(sub_group_id: int) -> str:
        return group_adapters[zero_optimizer.sub_group_to_group_id[sub_group_id]]

    def _get_norm_groups() -> list[Any]:
        norms = norm_groups()
        by_adapter: dict[str, list[Any]] = {}
        for sub_group_id, norm in enumerate(norms):
            by_adapter.setdefault(adapter_of(sub_group_id), []).append(norm)
        adapter_norms.clear()
        adapter_norms.update({name: combine_grad_norm_groups(found) for name, found in by_adapter.items()})
        return norms

    def unscale_and_clip_grads(sub_group_id: int, total_norm: Any) -> None:
        group = zero_optimizer.optimizer.param_groups[zero_optimizer.sub_group_to_group_id[sub_group_id]]
        own = group.get(GROUP_CLIP_KEY)
        zero_optimizer.clip_grad = default_clip if own is None else float(own)
        try:
            clip(sub_group_id, adapter_norms[adapter_of(sub_group_id)])
        finally:
            zero_optimizer.clip_grad = default_clip

    zero_optimizer._get_norm_groups = _get_norm_groups
    zero_optimizer.unscale_and_clip_grads = unscale_and_clip_grads
