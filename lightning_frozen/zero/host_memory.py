"""Host memory on DeepSpeed's CPU accelerator, where the gathered params and the activations are host memory too.

- **ZeRO-3's gather bounds.** DeepSpeed's defaults (``stage3_max_live_parameters`` and
  ``stage3_max_reuse_distance`` 1e9 elements, ``stage3_prefetch_bucket_size`` 5e7) let each rank keep most of the
  gathered model between its uses: on a GPU that is device memory, on the CPU accelerator host memory, once per
  rank. :func:`bound_gathers_on_cpu` sizes them to the model's largest module instead.
- **The allocator.** glibc keeps freed heap memory for reuse, and raises its mmap threshold each time a large
  buffer is freed (up to 32 MiB), so a process goes on holding what it once used. :func:`return_freed_memory`
  fixes the threshold at 1 MiB, as ``MALLOC_MMAP_THRESHOLD_=1048576`` would: every larger buffer is a mapping of
  its own, given back to the OS when freed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

from torch import nn

from lightning_frozen.zero.params import full_numel

# each bound, in elements, as a multiple of the model's largest module (the most ZeRO-3 gathers at once for one
# module): prefetch up to one such module ahead, hold no more than that gathered besides what runs, and gather a
# module again rather than keep it for a later use (measured: 245M Llama, 2 ranks, whole fit 2.7x the frozen bytes
# with 1/1/3, 1.98x with 1/0/1; benchmarks/load_memory/run.py)
GATHER_BOUNDS = {"stage3_prefetch_bucket_size": 1, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 1}
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


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


@functools.cache
def return_freed_memory() -> bool:
    """Make glibc's ``malloc`` give buffers of 1 MiB and more back to the OS when they are freed, for this process.

    Returns whether it did: not off Linux, nor where the C library is not glibc, nor where the user already chose a
    threshold (``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``). Buffers allocated before keep their placement.
    Called once per process.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in tunables:
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):  # musl's mallopt does nothing
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
