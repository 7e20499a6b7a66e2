"""What is left of the per-group scheduler tables: :func:`register_per_group_attributes`, which code written for
earlier versions calls, now a no-op that says so.

The strategy keeps the user's param groups as ``configure_optimizers`` built them, frozen params included (DeepSpeed
leaves them out of its ZeRO-3 partitions, group by group), so any LR scheduler acts on the groups it was built over.
"""

from __future__ import annotations

import warnings


def register_per_group_attributes(scheduler_class: type, *names: str) -> None:
    """Does nothing, and warns: every scheduler now works without declaring its per-group attributes (issue 39)."""
    warnings.warn(
        f"lightning-frozen: `register_per_group_attributes({scheduler_class.__name__}, ...)` is no longer needed and"
        " does nothing: the strategy keeps every param group, so any LR scheduler works as it is. Remove the call.",
        FutureWarning,
        stacklevel=2,
    )
