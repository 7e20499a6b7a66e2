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

# each bound, in elements, as a multiple of the model's largest module (the most ZeRO-3 gathers at once for one
# module): prefetch up to one such module ahead, hold no more than that gathered besides what runs, and gather a
# module again rather than keep it for a later use (measured: 245M Llama, 2 ranks, whole fit 2.7x the frozen bytes
# with 1/1/3, 1.98x with 1/0/1; benchmarks/load_memory/run.py)
GATHER_BOUNDS = {"stage3_prefetch_bucket_size": 1, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 1}
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20
GLIBC_MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's DEFAULT_MMAP_THRESHOLD_MIN, where its threshold starts


def bound_gathers_on_cpu(config: dict, model: nn.Module) -> dict[str, int]:
    """Give the resolved DeepSpeed ``config`` CPU defaults for ZeRO-3's gather bounds; return the ones it set.

    Each key of :data:`GATHER_BOUNDS` that ``config["zero_optimization"]`` lacks (under its ``stage3_`` name or its
    bare one), i.e. that the user did not set, becomes its multiple of the most elements one module of ``model``
    holds itself, so each rank holds about two modules gathered rather than most of the model. A key the user set is
    left as it is: setting them all (DeepSpeed's defaults are 5e7 and 1e9) opts out.
    """
    zero_config = config.setdefault("zero_optimization", {})
    largest = max((sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=1)
    applied = {}
    for key, multiple in GATHER_BOUNDS.items():
        if key not in zero_config and key.removeprefix("stage3_") not in zero_config:
            zero_config[key] = applied[key] = multiple * max(largest, 1)
    return applied


def return_freed_memory() -> Optional[Callable[[], None]]:
    """Make glibc's ``malloc`` give buffers of 1 MiB and more back to the OS when they are freed, for this process.

    Returns what sets the threshold back to glibc's starting one (128 KiB) at the end of the run, or None where it
    changed nothing: not off Linux, nor where the C library is not glibc, nor where the user already chose a threshold
    (``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``). Buffers allocated before keep their placement. glibc has no
    call that turns its sliding threshold on again once ``mallopt`` set one, so after a run the threshold stays at
    128 KiB instead of rising with the sizes freed.
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


# the most bytes kept, as a multiple of the largest size kept: at a transformer layer's turn from its attention to its
# MLP, the other shape's buffers wait a layer for their next use
DECODE_BUDGET_MULTIPLE = 2
# a size is kept only once this many params decoded that many values: the repeated layers of a model, not its
# embedding and head, whose decoded tensors (the largest of a model; TinyLlama-1.1B: 250 MiB each in fp32) would
# wait a whole step for their next use (measured, benchmarks/peer_qlora/run.py, 1.1B NF4, 1 rank: keeping them too
# raised the peak from 1.63 to 1.92 GiB)
PARAMS_PER_SIZE_KEPT = 3


class DecodeBuffers:
    """Host tensors of released frozen params, each given again to the next gather that decodes as many values.

    A tensor is kept only when nothing else holds its storage (a view autograd saved, a caller's reference), when at
    least :data:`PARAMS_PER_SIZE_KEPT` params asked for its size, and only while the kept bytes stay within
    :data:`DECODE_BUDGET_MULTIPLE` times the largest such size; beyond it the least recently kept go back to the
    allocator. One run's (its compute object's): :meth:`close` gives back all of them at its end, and from then on
    it keeps nothing. Safe to share between threads.
    """

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
