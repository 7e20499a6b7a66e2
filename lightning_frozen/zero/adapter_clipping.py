"""Gradient clipping per adapter in DeepSpeed's ZeRO-3 optimizer, for adapters trained at once (``adapters.py``).

DeepSpeed clips by one global norm over every param group, which couples adapters trained side by side: one
adapter's large gradient would shrink the others' steps. Here each adapter is clipped by the norm of its own
gradient, as if it trained alone, with the same ``gradient_clipping`` value (Lightning's ``gradient_clip_val``).

The contract bent, DeepSpeed 0.19's ``DeepSpeedZeroOptimizer_Stage3.step``: it takes one norm per sub-group from
``_get_norm_groups()`` (each already summed over every rank's partition, so over the whole tensor), combines them
with ``combine_grad_norm_groups`` and passes the result to ``unscale_and_clip_grads(sub_group_id, total_norm)`` for
every sub-group; ``sub_group_to_group_id`` maps a sub-group to its param group. Both methods are wrapped on the
optimizer instance: the first keeps the sub-group norms, the second gets the norm combined over the sub-groups of
the same adapter. An overflow (fp16) still skips the step of every adapter, as DeepSpeed decides it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_frozen.errors import UnsupportedConfigurationError

_STAGE3_CONTRACT = ("_get_norm_groups", "unscale_and_clip_grads", "sub_group_to_group_id", "clip_grad")


def clip_per_adapter(zero_optimizer: Any, group_adapters: Sequence[str]) -> None:
    """Make ``zero_optimizer`` clip each adapter's gradients by that adapter's own norm; ``group_adapters[i]`` names
    the adapter of param group ``i``. Does nothing without clipping or with fewer than two adapters.

    Raises:
        UnsupportedConfigurationError: the optimizer is not a ZeRO-3 optimizer of the shape this relies on (another
            DeepSpeed version or stage).
    """
    if len(set(group_adapters)) < 2 or not getattr(zero_optimizer, "clip_grad", 0):
        return
    missing = [name for name in _STAGE3_CONTRACT if not hasattr(zero_optimizer, name)]
    if missing:
        raise UnsupportedConfigurationError(
            "Clipping adapters trained at once needs DeepSpeed's ZeRO-3 optimizer, and"
            f" `{type(zero_optimizer).__name__}` lacks {', '.join(missing)} (DeepSpeed 0.19's stage 3 has them)."
            " Use ZeRO stage 3 with DeepSpeed 0.19, or train without `gradient_clip_val`."
        )
    from deepspeed.runtime.utils import combine_grad_norm_groups

    norm_groups, clip = zero_optimizer._get_norm_groups, zero_optimizer.unscale_and_clip_grads
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
        clip(sub_group_id, adapter_norms[adapter_of(sub_group_id)])

    zero_optimizer._get_norm_groups = _get_norm_groups
    zero_optimizer.unscale_and_clip_grads = unscale_and_clip_grads
