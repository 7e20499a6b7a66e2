"""Host memory on DeepSpeed's CPU accelerator, where the gathered params and the activations are host memory too:
ZeRO-3's gather bounds sized to the model's largest module (:func:`bound_gathers_on_cpu`), glibc's mmap threshold
fixed at 1 MiB so that freed buffers go back to the OS (:func:`return_freed_memory`), and a run's decoded tensors kept
for the next gather of the same size (:class:`DecodeBuffers`), since fresh pages cost the kernel's zeroing.
Measurements: docs/memory.md.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from lightning_frozen.capabilities import CPU_COMPUTE, available
from lightning_frozen.zero.params import full_numel

# each bound as a multiple of the model's largest module; measured: docs/internals.md, "Tuned constants"
GATHER_BOUNDS = {"stage3_prefetch_bucket_size": 1, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 1}
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20
GLIBC_MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's DEFAULT_MMAP_THRESHOLD_MIN, where its threshold starts


def bound_gathers_on_cpu(config: dict, model: nn.Module) -> dict[str, int]:
    """Give the resolved DeepSpeed ``config`` CPU defaults for ZeRO-3's gather bounds; return the ones it set: each
    key of :data:`GATHER_BOUNDS` the user did not set (under either name) becomes its multiple of the largest module
    of ``model``."""
    zero_config = config.setdefault("zero_optimization", {})
    largest = max((sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=1)
    applied = {}
    for key, multiple in GATHER_BOUNDS.items():
        if key not in zero_config and key.removeprefix("stage3_") not in zero_config:
            zero_config[key] = applied[key] = multiple * max(largest, 1)
    return applied


def return_freed_memory() -> Optional[Callable[[], None]]:
    """Make glibc's ``malloc`` give buffers of 1 MiB and more back to the OS when they are freed, for this process.

    Returns what sets the threshold back to glibc's starting one (128 KiB; its sliding threshold cannot be turned on
    again), or None where it changed nothing: off glibc, or where the user chose a threshold.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in tunables:
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):  # musl's mallopt does nothing
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return None
    return functools.partial(libc.mallopt, M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_BYTES)


# the most bytes kept, as a multiple of the largest size kept (a layer's attention and MLP shapes alternate)
DECODE_BUDGET_MULTIPLE = 2
# a size is kept only once this many params decoded it: the repeated layers, not the embedding and head
PARAMS_PER_SIZE_KEPT = 3


class DecodeBuffers:
    """Host tensors of released frozen params, each given again to the next gather that decodes as many values: kept
    only when nothing else holds its storage, its size was asked for by :data:`PARAMS_PER_SIZE_KEPT` params, and
    within :data:`DECODE_BUDGET_MULTIPLE` times the largest such size (least recently kept go first). After
    :meth:`close` it keeps nothing. Thread-safe."""

    def __init__(self) -> None:
        self._kept: OrderedDict[int, torch.Tensor] = OrderedDict()  # by id, least recently kept first
        self._askers: dict[tuple[int, torch.dtype], set[int]] = {}
        self._largest = 0
        self._open = True
        self._lock = threading.Lock()  # a gather waited on by a backward on autograd's thread, one by the forward
        self.bytes_kept = 0
        self.hits = 0

    def take(self, numel: int, dtype: torch.dtype, asker: int) -> Optional[torch.Tensor]:
        """A flat CPU tensor of ``numel`` values of ``dtype`` kept before, else None (the caller allocates).
        ``asker`` names the param it is for (its ``id``)."""
        with self._lock:
            if not self._open:
                return None
            askers = self._askers.setdefault((numel, dtype), set())
            if len(askers) < PARAMS_PER_SIZE_KEPT:
                askers.add(asker)
                if len(askers) == PARAMS_PER_SIZE_KEPT:
                    self._largest = max(self._largest, numel * dtype.itemsize)
            for key, tensor in self._kept.items():
                if tensor.numel() == numel and tensor.dtype == dtype:
                    del self._kept[key]
                    self.bytes_kept -= tensor.nbytes
                    self.hits += 1
                    return tensor
        return None

    def give(self, tensor: torch.Tensor) -> None:
        """Keep the storage under ``tensor`` (a released param's decoded values) if nothing else holds it."""
        if tensor.device.type != "cpu" or tensor.numel() == 0 or not available(CPU_COMPUTE):
            return
        storage = tensor.untyped_storage()
        # held by `storage` and the caller's `tensor`: more means a view or a reference lives elsewhere
        if torch._C._storage_Use_Count(storage._cdata) > 2 or storage.nbytes() % tensor.element_size():
            return
        flat = tensor.new_empty(0).set_(storage)
        del storage
        with self._lock:
            if not self._open or len(self._askers.get((flat.numel(), flat.dtype), ())) < PARAMS_PER_SIZE_KEPT:
                return
            self._kept[id(flat)] = flat
            self.bytes_kept += flat.nbytes
            while self.bytes_kept > DECODE_BUDGET_MULTIPLE * self._largest and self._kept:
                _, oldest = self._kept.popitem(last=False)
                self.bytes_kept -= oldest.nbytes

    def close(self) -> None:
        """Give every kept tensor back to the allocator and keep none from now on (the run ended)."""
        with self._lock:
            self._open = False
            self._kept.clear()
            self._askers.clear()
            self.bytes_kept = self._largest = 0
