"""What the DeepSpeed config that runs says about ZeRO (stage, offloads, pinning), the reduce bucket sized to the
trainable params, and the config of an engine without optimizer.

Read from the resolved config only, whether the strategy's arguments built it or ``config=`` gave it (a dict or a JSON
file), with DeepSpeed's own defaults for the keys it treats as optional.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def fit_reduce_bucket(config: dict, trainable_numel: int) -> None:
    """Size ZeRO-3's gradient reduce bucket, allocated up front and used by trainable gradients only, to the
    trainable elements when they are fewer than the default (Lightning's 2e8 is 763 MiB in fp32 for any adapter)."""
    zero_config = config.setdefault("zero_optimization", {})
    zero_config["reduce_bucket_size"] = fitted_reduce_bucket(trainable_numel)


def fitted_reduce_bucket(trainable_numel: int) -> int:
    """The reduce bucket ``frozen_deepspeed`` uses: Lightning's default, or the trainable elements if fewer."""
    return int(min(LIGHTNING_REDUCE_BUCKET_SIZE, max(trainable_numel, 1)))


def inference_config(config: dict) -> dict[str, Any]:
    """The DeepSpeed config for an engine without optimizer (validate/test/predict): the training config's precision
    and ZeRO settings."""
    inference: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
    for key in ("fp16", "bf16"):
        if key in config:
            inference[key] = config[key]
    # a user's config may leave out what DeepSpeed treats as optional (this engine has no optimizer anyway)
    inference["zero_optimization"] = config["zero_optimization"]
    if "zero_allow_untested_optimizer" in config:
        inference["zero_allow_untested_optimizer"] = config["zero_allow_untested_optimizer"]
    return inference
