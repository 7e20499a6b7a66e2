"""OpenMP threads that wait without spinning long, for a run on the CPU.

Torch runs its ops, and the codec its kernels, on one team of OpenMP threads (libgomp's, which torch brings). A thread
of that team that waits for the others, at the end of a parallel region or for the next one, spins up to 300,000
times before it sleeps (libgomp's default, ``GOMP_SPINCOUNT``). On a machine whose cores all run one thread of the
team that costs nothing; where another thread takes a core (another process, a neighbour's vCPU on the same core),
the spinner holds its core while the thread it waits for cannot run, and a step of the 1.1B NF4 benchmark took 39-98 s
instead of 5 s beside one busy process (docs/internals.md, "Steadiness of a step"). libgomp spins only 100 times when
it manages more threads than the CPUs it may use; :func:`spin_briefly` keeps one more thread for the run, asleep,
so that it does. A user who set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` keeps their choice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Optional

import torch

from lightning_frozen.format import native_codec

THREAD_NAME = "lightning-frozen OpenMP waits"


def spin_briefly() -> Optional[Callable[[], None]]:
    """Until the returned function is called, libgomp's waiting threads spin briefly, then sleep. None where that
    changes nothing or is not ours to change: one torch thread, fewer torch threads than CPUs (a core stays free), the
    user's own wait policy, an OpenMP runtime other than torch's libgomp, or no compiled kernels."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return None
    if not hasattr(os, "sched_getaffinity") or torch.get_num_threads() < max(2, len(os.sched_getaffinity(0))):
        return None
    if not _torch_runs_libgomp():
        return None
    kernels = native_codec.kernels()
    if kernels is None or not kernels.lf_openmp():
        return None
    kernels.lf_openmp_hold()
    # a team of two adds one thread to the ones libgomp manages: torch's team of as many threads as CPUs, plus it
    parked = threading.Thread(target=kernels.lf_openmp_park, args=(2,), name=THREAD_NAME, daemon=True)
    parked.start()

    def release() -> None:
        kernels.lf_openmp_release()
        parked.join(timeout=10)

    return release


def _torch_runs_libgomp() -> bool:
    """Whether this process's OpenMP runtime is GNU's libgomp alone (torch's wheels), the one whose spinning this
    throttles and whose name the codec's build links against."""
    try:
        with open("/proc/self/maps") as maps:
            names = {line.rsplit("/", 1)[-1].strip() for line in maps if ".so" in line}
    except OSError:
        return False
    return any(name.startswith("libgomp") for name in names) and not any(
        name.startswith(("libiomp", "libomp")) for name in names
    )
