"""A gloo process group's exit: destroyed, then its worker threads idle, before the interpreter is torn down.

Behind ``zero/frozen_compute.py``: what it watches (the worker threads torch names, their futex waits in ``/proc``) is
Linux's and torch's internals, not the core's; a run registers it through the door.
"""

from __future__ import annotations

import atexit
import functools
import os
import platform
import sys
import time
from typing import Optional

import torch.distributed as dist


@functools.cache
def destroy_gloo_group_at_exit() -> None:
    """At interpreter exit, while Python is still whole: destroy a gloo default process group, then wait until gloo's
    worker threads are idle (:func:`end_gloo_work`). Registered once per process."""
    atexit.register(end_gloo_work)


# torch's ProcessGroupGloo names its worker threads so (c10::setThreadName; 15 characters, the kernel's limit)
GLOO_WORKER_THREAD = "pt_gloo_runloop"
# the futex syscall's number, the first field of /proc/self/task/<tid>/syscall while a thread waits in it
_FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98}
# futex's 2nd arg: the command, with FUTEX_PRIVATE_FLAG (128) and FUTEX_CLOCK_REALTIME (256) masked off. An idle
# worker waits on its queue's condition variable, which glibc (2.25 on; torch's wheels need 2.28) waits in with
# FUTEX_WAIT_BITSET; a worker inside a collective that waits to lock a mutex (one gloo's transport thread holds while
# it reads the socket) waits in FUTEX_WAIT, also without a timeout, and is not idle.
_FUTEX_CMD_MASK = ~(128 | 256)
_FUTEX_WAIT_BITSET = 9


def end_gloo_work(timeout: float = 10.0) -> None:
    """Destroy a gloo default group (through ``deepspeed.comm`` when it is initialized, so that DeepSpeed lets go of
    its group handles too) and wait, at most ``timeout`` seconds, until gloo's workers are idle, so that none takes
    the GIL during finalization (docs/internals.md). A group the user destroyed, or an NCCL one, is left alone.
    """
    try:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            comm = sys.modules.get("deepspeed.comm")
            if comm is not None and comm.is_initialized():
                comm.destroy_process_group()
            else:
                dist.destroy_process_group()
    finally:
        wait_for_idle_gloo_workers(timeout)


def wait_for_idle_gloo_workers(timeout: float = 10.0, poll: float = 0.002, polls_in_a_row: int = 5) -> bool:
    """Wait until every gloo worker thread of this process has been idle (on a condition variable, in a futex without a
    timeout) for ``polls_in_a_row`` polls ``poll`` seconds apart, or ``timeout`` seconds passed; whether they became
    idle. Linux on x86_64 and aarch64 only: elsewhere, or without ``/proc``, False at once."""
    futex = _FUTEX_SYSCALL.get(platform.machine())
    deadline = time.monotonic() + timeout
    idle_polls = 0
    while futex is not None:
        idle = _gloo_workers_idle(futex)
        if idle is None:
            return False
        idle_polls = idle_polls + 1 if all(idle) else 0
        if not idle or idle_polls >= polls_in_a_row:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return False


def _gloo_workers_idle(futex: int) -> Optional[list[bool]]:
    """For each gloo worker thread, whether it waits on a condition variable (``futex`` with FUTEX_WAIT_BITSET) without
    a timeout; None where /proc does not say."""
    idle = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() != GLOO_WORKER_THREAD:
                    continue
            with open(f"/proc/self/task/{task}/syscall") as syscall:
                # "number arg1 ... arg6 sp pc" in a syscall, "running" or "-1 sp pc" outside one; futex's 2nd arg is
                # its command, its 4th its timeout
                fields = syscall.read().split()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile (ENOENT, or ESRCH while it goes)
            continue
        except OSError:
            return None
        idle.append(
            len(fields) > 4
            and fields[0] == str(futex)
            and int(fields[2], 16) & _FUTEX_CMD_MASK == _FUTEX_WAIT_BITSET
            and int(fields[4], 16) == 0
        )
    return idle
