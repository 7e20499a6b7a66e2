"""What the DeepSpeed config that runs says about ZeRO: stage, offloads, pinning and bucket sizing.

Read from the resolved config only, whether the strategy's arguments built it or ``config=`` gave it (a dict or a JSON
file), with DeepSpeed's own defaults for the keys it treats as optional.
"""

from __future__ import annotations

from dataclasses import dataclass

# Lightning's DeepSpeedStrategy default `reduce_bucket_size`, in elements
LIGHTNING_REDUCE_BUCKET_SIZE = 200_000_000


@dataclass(frozen=True)
class ZeroSettings:
    """What the DeepSpeed config that runs says about ZeRO, whether the strategy's arguments built it or ``config=``
    gave it (a dict, or the path of its JSON file)."""

    stage: int
    offload_optimizer: bool  # the optimizer steps on the CPU (or NVMe)
    offload_param: bool  # DeepSpeed offloads every param itself
    pin_memory: bool  # offloaded tensors in page-locked memory
    # no `reduce_bucket_size`, or Lightning's default: the strategy sizes the bucket to the trainable params
    fit_reduce_bucket: bool


def zero_settings(config: dict, pin_memory: bool = False) -> ZeroSettings:
    """Read :class:`ZeroSettings` from a resolved DeepSpeed config, with DeepSpeed's defaults for the keys it treats as
    optional (no ``zero_optimization``: stage 0; the legacy boolean ``zero_optimization``: stage 1 or 0; the legacy
    ``cpu_offload`` flags). ``pin_memory`` pins the frozen shards this package offloads when no offload section says."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        zero = {"stage": 1 if zero else 0}
    sections = {
        key: zero.get(key) if isinstance(zero.get(key), dict) else {} for key in ("offload_optimizer", "offload_param")
    }
    offloaded = {key: section.get("device", "none") not in (None, "none") for key, section in sections.items()}
    pinned = [bool(section.get("pin_memory")) for key, section in sections.items() if offloaded[key]]
    return ZeroSettings(
        stage=int(zero.get("stage", 0)),
        offload_optimizer=offloaded["offload_optimizer"] or bool(zero.get("cpu_offload")),
        offload_param=offloaded["offload_param"] or bool(zero.get("cpu_offload_param")),
        pin_memory=any(pinned) if pinned else pin_memory,
        fit_reduce_bucket=zero.get("reduce_bucket_size", LIGHTNING_REDUCE_BUCKET_SIZE) == LIGHTNING_REDUCE_BUCKET_SIZE,
    )
