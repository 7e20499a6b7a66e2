"""One benchmark configuration in fresh processes: their environment, and the guarded run.

The run gets its own process group (Lightning's launcher starts the other ranks inside it), watched every
``GUARD_SAMPLE_S``: on a timeout, when the group holds more anonymous memory, plus the machine's shared memory
that appeared since it started (counted once), than the limit, when the
machine's available memory falls below a floor, or when a rank reported an error and the group is still there a
minute later, the whole group is killed and the outcome says which and why. So one configuration cannot take the
machine down, and a hung rank does not hold the next one up. No torch here: a driver that imports it stays a light
process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness.probes import available_bytes, meminfo_bytes, proc_status
from benchmarks.harness.records import REPO, rank_errors

GUARD_SAMPLE_S = 0.2
ERROR_GRACE_S = 60  # after a rank reported an error, the others get this long to finish before the group is killed
SHM_LOCKS = Path.home() / ".cache" / "torch_extensions"
MMAP_1MIB = str(2**20)  # glibc's MALLOC_MMAP_THRESHOLD_: every freed buffer above 1 MiB leaves the process at once


def child_env(
    threads: Optional[int] = None, mmap_1mib: Optional[bool] = None, package: Optional[Path] = None
) -> dict[str, str]:
    """The environment of a configuration's processes: this one's, offline, importing ``package`` (default: this
    checkout) and the benchmarks before what this one's ``PYTHONPATH`` names; ``threads`` torch threads per process
    (None: torch's default); glibc's mmap threshold at 1 MiB (True), removed as a user runs (False), or as inherited
    (None)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # what the caller's PYTHONPATH adds stays, after them (e.g. the set-up's `.venv/tests-only`, bitsandbytes' folder)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(str(p) for p in (package or REPO, REPO, *inherited)))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if mmap_1mib:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_1MIB
    elif mmap_1mib is False:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    return env


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def guarded_run(
    command: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout_min: float,
    memory_limit_gib: Optional[float] = None,
    min_available_gib: float = 1.0,
    reports_dir: Optional[Path] = None,
) -> dict[str, Any]:
    """Run ``command`` in its own process group, its output in ``log_path``; kill the group on timeout, over
    ``memory_limit_gib`` (None: no limit of its own), under ``min_available_gib`` of the machine's, or when a rank
    report in ``reports_dir`` has an error and the group is still there ``ERROR_GRACE_S`` later.

    Returns the outcome: ``status`` (``ok``: it exited by itself, whatever its exit code; ``timeout``,
    ``exceeded``, ``error``: killed), ``reason``, ``returncode``, ``wall_s`` and the group's simultaneous peaks
    (sums over its processes, sampled every ``GUARD_SAMPLE_S``).
    """
    limit = memory_limit_gib * 2**30 if memory_limit_gib is not None else float("inf")
    floor_available = min_available_gib * 2**30
    peaks = {"anon_shmem": 0, "rss": 0}
    shmem_before = meminfo_bytes("Shmem")
    outcome: dict[str, Any] = {"status": "ok"}
    started = time.monotonic()
    error_seen: Optional[float] = None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        polls = 0
        while process.poll() is None:
            time.sleep(GUARD_SAMPLE_S)
            polls += 1
            fields = [proc_status(("RssAnon", "VmRSS"), pid) for pid in _group_pids(process.pid)]
            # shared memory once, however many ranks map it (they all map the frozen codes: zero/frozen_files.py)
            held = sum(f["RssAnon"] for f in fields) + max(0, meminfo_bytes("Shmem") - shmem_before)
            peaks = {
                "anon_shmem": max(peaks["anon_shmem"], held),
                "rss": max(peaks["rss"], sum(f["VmRSS"] for f in fields)),
            }
            elapsed = time.monotonic() - started
            reason = None
            if held > limit:
                reason = (
                    "exceeded",
                    f"the run's processes held {held / 2**30:.2f} GiB (anonymous + shared),"
                    f" over the --memory-limit-gib of {memory_limit_gib}",
                )
            elif available_bytes() < floor_available:
                reason = (
                    "exceeded",
                    f"the machine's available memory fell below {min_available_gib} GiB"
                    f" (the run held {held / 2**30:.2f} GiB)",
                )
            elif elapsed > timeout_min * 60:
                reason = ("timeout", f"still running after {timeout_min} min")
            elif reports_dir is not None and error_seen is None and polls % 10 == 0 and rank_errors(reports_dir):
                error_seen = elapsed
            elif error_seen is not None and elapsed - error_seen > ERROR_GRACE_S:
                reason = ("error", f"a rank reported an error; the group was still running {ERROR_GRACE_S} s later")
            if reason:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                outcome = {"status": reason[0], "reason": reason[1], "at_s": round(elapsed, 1)}
                break
        if _group_pids(process.pid):  # rank processes whose parent already exited
            os.killpg(process.pid, signal.SIGKILL)
    outcome.update(
        returncode=process.returncode,
        wall_s=round(time.monotonic() - started, 1),
        node_peak_anon_shmem=peaks["anon_shmem"],
        node_peak_rss_sum=peaks["rss"],
    )
    locks = [str(p) for p in SHM_LOCKS.glob("*/deepspeed_shm_comm/lock")]
    if locks and outcome["status"] != "ok":
        outcome["left_locks"] = locks  # a run killed while it checked the build leaves these; later runs hang
    return outcome


def exit_status(outcome: dict[str, Any]) -> Any:
    """The exit code of a process that exited by itself, else why it was killed (``timeout``, ``exceeded``...)."""
    return outcome["returncode"] if outcome["status"] == "ok" else outcome["status"]
