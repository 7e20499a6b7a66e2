"""torch's OpenMP threads spin while they wait, except while other threads take the process's cores.

Torch runs its ops, and the codec its kernels, on one team of OpenMP threads (libgomp's, which torch brings). A thread
of that team that waits, for the others at the end of a parallel region or for the next one, spins up to 300,000
times before it sleeps (libgomp's default, ``GOMP_SPINCOUNT``). On cores of its own that is the fastest way to wait:
a sleeping thread costs a wake-up at every parallel region, and a step of thousands of them ran 1.3x as long with
every wait brief. Where another thread takes one of the cores (another process, a neighbour's vCPU on the same
core), the spinner holds its core while the thread it waits for cannot run, and the same step ran 4-10x as long
(docs/internals.md, "Steadiness of a step").

:class:`WaitingThreads` tells the two apart at each step by the time the thread that runs the step was ready to run
and waited for a CPU (the kernel's schedstat): under 1% of the wall time on cores of its own, 44-48% of it beside a
busy process, brief waits or not. While it waits that much, it keeps one more OpenMP thread asleep: libgomp then
manages more threads than the CPUs the process may use, and spins 100 times, not 300,000, before a waiting thread
sleeps (libgomp's manual, ``GOMP_SPINCOUNT``). A user who set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` keeps their
choice.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

import torch

from lightning_frozen.format import native_codec

THREAD_NAME = "lightning-frozen OpenMP waits"
# seconds the step's thread waited for a CPU, per second, above which other threads share the cores; measured: under
# 0.01 alone, 0.44-0.48 beside a busy process, brief waits or not (docs/internals.md)
CONTENDED_WAIT = 0.1
MIN_WINDOW_S = 0.5  # steps shorter than this are read together


class WaitingThreads:
    """For a run on the CPU: at each :meth:`check` (any step's start, on the thread that runs the steps), brief waits
    while that thread waited for a CPU much since the last check, libgomp's own spinning otherwise; :meth:`close` at
    the run's end. The waits start brief: the first check only starts the count (what came before, the load, runs
    threads of its own), so the first step is run before anything is known, and a first step spinning beside a busy
    process took 64.6 s where one with brief waits takes 1.28x a spinning one on cores of its own."""

    def __init__(self, kernels: Any) -> None:
        self._kernels = kernels
        self._parked: Optional[threading.Thread] = None
        self._since: Optional[float] = None
        self._waited = 0.0
        self._park()
        self.switched = 0  # how often the waits changed, for the docs' measurements and the tests

    @property
    def brief(self) -> bool:
        """Whether the waits are brief now."""
        return self._parked is not None

    def check(self) -> None:
        """Make the waits brief if this thread waited for a CPU more than :data:`CONTENDED_WAIT` seconds a second since
        the last check of at least :data:`MIN_WINDOW_S`, libgomp's own if not."""
        now, waited = time.perf_counter(), cpu_wait_s()
        if self._since is None:
            self._since, self._waited = now, waited
            return
        if now - self._since < MIN_WINDOW_S:
            return
        contended = (waited - self._waited) / (now - self._since) > CONTENDED_WAIT
        self._since, self._waited = now, waited
        if contended != self.brief:
            self._park() if contended else self.close()
            self.switched += 1

    def close(self) -> None:
        """libgomp's own waits again."""
        if self._parked is not None:
            self._kernels.lf_openmp_release()
            self._parked.join(timeout=10)
            self._parked = None

    def _park(self) -> None:
        self._kernels.lf_openmp_hold()
        # a team of two adds one thread to those libgomp manages: torch's team of as many threads as CPUs, plus it
        self._parked = threading.Thread(target=self._kernels.lf_openmp_park, args=(2,), name=THREAD_NAME, daemon=True)
        self._parked.start()


def for_this_process() -> Optional[WaitingThreads]:
    """A :class:`WaitingThreads` for a run, or None where its waits are not this package's to change or changing them
    does nothing: one torch thread, fewer torch threads than CPUs (a core stays free), the user's own wait policy, an
    OpenMP runtime beside torch's libgomp or instead of it, or no compiled kernels."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return None
    if not hasattr(os, "sched_getaffinity") or torch.get_num_threads() < max(2, len(os.sched_getaffinity(0))):
        return None
    kernels = native_codec.kernels()
    # after the kernels load: a team parked in a runtime of their own would not make torch's libgomp throttle its spins
    if kernels is None or not kernels.lf_openmp() or not native_codec.torchs_libgomp_alone():
        return None
    return WaitingThreads(kernels)


def cpu_wait_s() -> float:
    """Seconds the calling thread has so far been ready to run and waited for a CPU (the second field of its
    ``/proc/thread-self/schedstat``); 0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0
