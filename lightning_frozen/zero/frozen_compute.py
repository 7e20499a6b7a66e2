"""The one door between the core and how frozen shards are computed: :func:`frozen_compute_for` a device gives a
:class:`FrozenCompute` with the few operations the strategy and the engine call, and :data:`KERNELS` are the compiled
passes the codec, the frozen storage and the fingerprint take as a value (they run tensor ops without them). What is
behind it (``zero/compute/``) a reader may skip; each run makes its own compute object and hands it down as a value
(docs/internals.md, "The core, the seams, and the compute behind one door").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lightning_frozen.capabilities import CPU_COMPUTE, available
from lightning_frozen.format import native_codec
from lightning_frozen.format.codec import Kernels
from lightning_frozen.zero import frozen_files
from lightning_frozen.zero.compute import coded_experts, gloo_exit, host_memory, quantized, waiting_threads
from lightning_frozen.zero.frozen_storage import SourceValues, frozen_dtype_of

# the CPU's compiled codec and checksum, for values in CPU memory whatever device computes (offloaded shards, slices
# as they are read); they decline any other tensor
KERNELS: Kernels = native_codec.KERNELS


class FrozenCompute:
    """Frozen shards on an accelerator: quantized at setup, gathered to the device and decoded whole there."""

    def __init__(self, param_lora: Optional[coded_experts.ParamLora] = None) -> None:
        self.tables = quantized.RunTables()  # this run's, handed to each gather it installs
        self.param_lora = param_lora  # LoRA on a param itself, as routed experts read it (the hf seam's)
        self.waits: Optional[waiting_threads.WaitingThreads] = None  # brief OpenMP waits, on the CPU

    def bound_gathers(self, config: dict, model: nn.Module) -> dict[str, int]:
        """Give the DeepSpeed ``config`` this device's defaults for ZeRO-3's gather bounds the user left unset;
        return the ones set."""
        return {}

    def set_process_memory(self) -> Optional[Callable[[], None]]:
        """Set how the process gives memory back for the run; return what sets it back, or None."""
        return None

    def watch_waits(self) -> Optional[Callable[[], None]]:
        """For the run: the process's waiting compute threads sleep soon while other threads share its cores, as
        checked at each :meth:`step_starts`; return what ends that, or None."""
        return None

    def step_starts(self) -> None:
        """A training, validation, test or predict step starts, on the thread that runs the steps."""

    def prepare(
        self,
        model: nn.Module,
        frozen_dtype: str,
        before_encoding: Optional[SourceValues] = None,
        spill: Optional[Path] = None,
    ) -> int:
        """After the engine is built: store each frozen shard of ``model`` as ``frozen_dtype`` codes, gathered and
        decoded from then on; ``before_encoding`` is told each shard's values first. Return how many were stored.
        ``spill``: where the ranks of a machine may share the codes on disk when ``/dev/shm`` has no room.

        Raises:
            FrozenDtypeError: a stored param was made trainable, or a frozen param is not a released ZeRO-3 shard.
        """
        return quantized.quantize_frozen_shards(model, frozen_dtype, self.tables, before_encoding)

    def end_run(self) -> None:
        """After a run: what :meth:`prepare` changed outside the params undone, what its tables hold let go; gathers
        after it decode whole and keep nothing."""
        self.tables.layers.end_of_run()
        self.tables.buffers.close()


class CpuFrozenCompute(FrozenCompute):
    """Frozen shards on DeepSpeed's CPU accelerator, where gathered params are host memory: gather bounds and glibc's
    mmap threshold set, each machine's codes shared by its ranks, layers computed from their codes, compiled kernels,
    OpenMP threads that sleep soon when they wait while others share the cores."""

    def bound_gathers(self, config: dict, model: nn.Module) -> dict[str, int]:
        return host_memory.bound_gathers_on_cpu(config, model)

    def set_process_memory(self) -> Optional[Callable[[], None]]:
        return host_memory.return_freed_memory()

    def watch_waits(self) -> Optional[Callable[[], None]]:
        self.waits = waiting_threads.for_this_process()
        return None if self.waits is None else self.waits.close

    def step_starts(self) -> None:
        if self.waits is not None:
            self.waits.check()

    def prepare(
        self,
        model: nn.Module,
        frozen_dtype: str,
        before_encoding: Optional[SourceValues] = None,
        spill: Optional[Path] = None,
    ) -> int:
        done = super().prepare(model, frozen_dtype, before_encoding)
        frozen_files.share_codes(list(model.parameters()), frozen_dtype_of, spill)  # each other's codes, no copies
        self.tables.layers.compute_from_codes(model, frozen_dtype_of)
        coded_experts.compute_experts_from_codes(self.tables.layers, model, frozen_dtype_of, self.param_lora)
        return done


def frozen_compute_for(device: torch.device, param_lora: Optional[coded_experts.ParamLora] = None) -> FrozenCompute:
    """How frozen shards compute on ``device``: the CPU's stack (its names as written for), else an accelerator's.
    ``param_lora`` reads LoRA on a param itself (``hf/peft_adapters.PARAM_LORA``), for MoE experts under it."""
    if device.type == "cpu" and available(CPU_COMPUTE):
        return CpuFrozenCompute(param_lora)
    return FrozenCompute(param_lora)


def compute_from_codes(param: nn.Parameter, before_encoding: Optional[SourceValues] = None) -> None:
    """``param``'s shard holds codes already (stored as the loader read it): gather and decode them from now on; a
    write to it tells ``before_encoding`` its new values before they are encoded. Until the run's ``prepare`` hands
    it the run's tables, its gathers decode whole and keep nothing (empty tables of its own)."""
    quantized.install_quantized_gather(param, quantized.RunTables(), before_encoding)


def exit_cleanly() -> None:
    """At the process's exit, destroy a gloo default group and wait until its workers are idle, before the interpreter
    is torn down (``zero/compute/gloo_exit.py``); registered once per process."""
    gloo_exit.destroy_gloo_group_at_exit()
