"""The strategy's one resolved spec: its own arguments and what the DeepSpeed config that runs says about ZeRO.

Like Lightning's ``DeepSpeedStrategy``, which folds its arguments into one ``self.config`` at construction, the
strategy resolves its arguments once (``arguments.resolve_spec``), and every module reads this object, or a field of it
handed down as a value. Plain values only: any floor of the package may import it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional, Union


@dataclass(frozen=True)
class StrategySpec:
    """What a ``FrozenAwareDeepSpeedStrategy`` was asked for, resolved at construction: from the DeepSpeed config that
    runs where the config decides, else from the arguments. Only ``frozen_dtype`` may be completed at setup, by a
    bitsandbytes ``quantization_config`` (:meth:`with_frozen_dtype`)."""

    stage: int  # the ZeRO stage (always 3: the strategy refuses others)
    offload_frozen: bool  # frozen shards in CPU memory
    offload_optimizer: bool  # the optimizer steps on the CPU (or NVMe): the config's `offload_optimizer` section
    offload_param: bool  # DeepSpeed offloads every param itself: the config's `offload_param` section
    pin_memory: bool  # offloaded tensors in page-locked memory
    fit_reduce_bucket: bool  # the config sets no `reduce_bucket_size` (or Lightning's): size it to the trainable params
    convert_lr_zero_groups: bool  # params only in groups whose learning rate stays 0 are frozen
    frozen_dtype: Optional[str]  # how frozen shards are stored: None (the compute dtype), "int8", "nf4", "bf16", "fp16"
    fingerprint: str  # how checkpoints verify the frozen base: "checksum", "sha256" or "none"
    frozen_base: Optional[Union[str, os.PathLike]]  # the base's reference as given; found from the module when None
    return_freed_memory: bool  # on the CPU, glibc gives freed buffers of 1 MiB+ back to the OS
    preemption_grace: float  # seconds from a SIGTERM to a rank's exit
    generation_memory: Optional[int] = None  # bytes `generate` may gather whole at once; None: half the free memory
    uneven_batches: str = "join"  # ranks that run out of data: "join" (serve the others on stand-ins) or "raise"
    code_cache: Union[bool, str, os.PathLike] = True  # where the stored base is kept for the next fit; False: nowhere

    def with_frozen_dtype(self, frozen_dtype: Optional[str]) -> StrategySpec:
        """This spec with ``frozen_dtype`` (itself when it is the same)."""
        return self if frozen_dtype == self.frozen_dtype else dataclasses.replace(self, frozen_dtype=frozen_dtype)


def spec_fields(*names: str) -> tuple[Any, ...]:
    """Read-only properties of a class with a ``spec``, one per field of ``names``: public attributes kept as views of
    the spec, nothing copied."""
    return tuple(_field(name) for name in names)


def _field(name: str) -> Any:
    return property(lambda owner: getattr(owner.spec, name), doc=f"``spec.{name}``: see :class:`StrategySpec`.")
