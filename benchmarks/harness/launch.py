"""What ``big_model.py`` does around a configuration's processes: the page cache and the plain read of the
checkpoint files, and the guarded run (its own process group, killed on a timeout, on the memory guard, or when a
rank reported an error and the others are still there a minute later). Standard library only: the driver that
imports it holds no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

GUARD_SAMPLE_S = 0.2
ERROR_GRACE_S = 60  # after a rank reported an error, the others get this long to finish before the group is killed
SHM_LOCKS = Path.home() / ".cache" / "torch_extensions"


# ------------------------------------------------------------------------------------------------ page cache, reads


def resident_bytes(paths: list[Path]) -> Optional[int]:
    """Bytes of ``paths`` in the page cache (util-linux ``fincore``); None where it is missing."""
    if not shutil.which("fincore"):
        return None
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *map(str, paths)], capture_output=True, text=True)
    return sum(int(line) for line in out.stdout.split()) if out.returncode == 0 else None


def evict(paths: list[Path]) -> dict[str, Any]:
    """Drop ``paths`` from the page cache: ``posix_fadvise(DONTNEED)`` per file, else (as root) ``drop_caches``."""
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    method, left = "posix_fadvise", resident_bytes(paths)
    if left and os.geteuid() == 0:
        subprocess.run(["sync"])
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        method, left = "drop_caches", resident_bytes(paths)
    return {"method": method, "resident_after": left}


def plain_read(paths: list[Path]) -> dict[str, Any]:
    """Read every file once, sequentially, into one 64 MiB buffer: the time a loader cannot beat."""
    buffer = bytearray(64 * 2**20)
    view = memoryview(buffer)
    total, started = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while count := file.readinto(view):
                total += count
    seconds = time.perf_counter() - started
    return {"bytes": total, "s": round(seconds, 2), "mib_s": round(total / 2**20 / seconds, 1)}


def prepare_cache(paths: list[Path], mode: str) -> dict[str, Any]:
    """The plain read of ``paths``, cold (evicted before it, and again before the run) or warm (read once first)."""
    total = sum(p.stat().st_size for p in paths)
    info: dict[str, Any] = {"mode": mode, "files_bytes": total, "resident_before_read": resident_bytes(paths)}
    if mode == "cold":
        info["evict_before_read"] = evict(paths)
    else:
        plain_read(paths)
        info["resident_after_warming"] = resident_bytes(paths)
    info["plain_read"] = plain_read(paths)
    if mode == "cold":
        info["evict_before_run"] = evict(paths)
    info["resident_before_run"] = resident_bytes(paths)
    return info


# ------------------------------------------------------------------------------------------------ the guarded run


def _status_kib(pid: int, fields: tuple[str, ...]) -> dict[str, int]:
    values = dict.fromkeys(fields, 0)
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name = line.split(":", 1)[0]
                if name in values:
                    values[name] = int(line.split()[1])
    except OSError:
        pass
    return values


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


def _available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank_errors(run_dir: Path) -> list[str]:
    errors = []
    for path in run_dir.glob("rank*.json"):
        try:
            errors += list(json.loads(path.read_text()).get("errors", {}))
        except (OSError, ValueError):
            continue
    return errors


def guarded_run(
    command: list[str],
    env: dict[str, str],
    run_dir: Path,
    timeout_min: float,
    memory_limit_gib: float,
    min_available_gib: float,
) -> dict[str, Any]:
    """Run ``command`` in its own process group; kill the group on timeout, on the memory guard, or when a rank has
    reported an error and the group is still there ``ERROR_GRACE_S`` later. Returns the outcome and the node's
    simultaneous peaks (sum over the group's processes, sampled every ``GUARD_SAMPLE_S``)."""
    limit = memory_limit_gib * 2**30
    floor_available = min_available_gib * 2**30
    peaks = {"anon_shmem": 0, "rss": 0}
    outcome: dict[str, Any] = {"status": "ok"}
    started = time.monotonic()
    error_seen: Optional[float] = None
    with open(run_dir / "worker.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        polls = 0
        while process.poll() is None:
            time.sleep(GUARD_SAMPLE_S)
            polls += 1
            pids = _group_pids(process.pid)
            fields = [_status_kib(pid, ("RssAnon", "RssShmem", "VmRSS")) for pid in pids]
            held = sum(f["RssAnon"] + f["RssShmem"] for f in fields) * 1024
            peaks = {
                "anon_shmem": max(peaks["anon_shmem"], held),
                "rss": max(peaks["rss"], sum(f["VmRSS"] for f in fields) * 1024),
            }
            elapsed = time.monotonic() - started
            reason = None
            if held > limit:
                reason = (
                    "exceeded",
                    f"the run's processes held {held / 2**30:.2f} GiB (anonymous + shared),"
                    f" over the --memory-limit-gib of {memory_limit_gib}",
                )
            elif _available_bytes() < floor_available:
                reason = (
                    "exceeded",
                    f"the machine's available memory fell below {min_available_gib} GiB"
                    f" (the run held {held / 2**30:.2f} GiB)",
                )
            elif elapsed > timeout_min * 60:
                reason = ("timeout", f"still running after {timeout_min} min (--timeout-min)")
            elif error_seen is None and polls % 10 == 0 and _rank_errors(run_dir):
                error_seen = elapsed
            elif error_seen is not None and elapsed - error_seen > ERROR_GRACE_S:
                reason = ("error", f"a rank reported an error; the group was still running {ERROR_GRACE_S} s later")
            if reason:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                outcome = {"status": reason[0], "reason": reason[1], "at_s": round(elapsed, 1)}
                break
        leftovers = _group_pids(process.pid)
        if leftovers:  # rank processes whose parent already exited
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
