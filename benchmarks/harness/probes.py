"""What a benchmark reads off the machine: a process's memory (``/proc``, USS), load average, page cache, bytes.

Linux only (``/proc``). Importing this module imports nothing heavy, so a driver that holds no torch can use it;
:func:`count_gathered_bytes` and :func:`snapshot` import DeepSpeed when called, in the rank processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import psutil

from benchmarks.harness.records import write_json

MEMORY_KINDS = ("uss", "anon", "rss")  # what the sampler keeps a peak of


def proc_status(fields: tuple[str, ...], pid: Union[int, str] = "self") -> dict[str, int]:
    """``fields`` of ``/proc/<pid>/status`` in bytes (kB lines); 0 for a field that is missing or a process gone."""
    values = dict.fromkeys(fields, 0)
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name = line.split(":", 1)[0]
                if name in values:
                    values[name] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return values


def proc_status_bytes(field: str) -> int:
    """One field of this process's ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``, ``RssAnon``...).

    Raises:
        RuntimeError: the kernel does not report ``field``.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset this process's RSS high-water mark (``VmHWM``) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def memory_now() -> dict[str, int]:
    """This process's USS (pages no other process maps), anonymous resident memory and RSS, in bytes.

    The frozen codes that ranks on one machine share (``zero/frozen_files.py``) are mapped by every rank, so no
    rank's USS holds them: each rank's USS here adds the bytes of its own shards in them, and the sum over ranks is the
    machine's. Between writing its shards and the others mapping them (inside ``share_codes``) a rank counts them
    twice: an upper bound."""
    uss = psutil.Process().memory_full_info().uss
    frozen_files = sys.modules.get("lightning_frozen.zero.frozen_files")
    if frozen_files is not None:
        uss += frozen_files.owned_bytes()
    status = proc_status(("RssAnon", "VmRSS"))
    return {"uss": uss, "anon": status["RssAnon"], "rss": status["VmRSS"]}


SAMPLER_SHARE = 20  # a memory sample costs at most this fraction's inverse of one core's time


class PeakSampler(threading.Thread):
    """Samples this process's :func:`memory_now` every ``interval_s`` (or less often, where a sample is slow: see
    :data:`SAMPLER_SHARE`) in a thread and keeps the peaks.

    :meth:`peaks` reads them; :meth:`end_phase` reads and starts the next phase's from what is held now. With a
    ``running_file``, every ``write_every_s`` the current peaks replace that file, so that a run killed mid-phase
    (timeout, memory guard) still says how much it held.
    """

    def __init__(
        self, interval_s: float = 0.05, running_file: Optional[Path] = None, write_every_s: float = 2.0
    ) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.running_file = running_file
        self.write_every_s = write_every_s
        self.peak = dict.fromkeys(MEMORY_KINDS, 0)
        self.lock = threading.RLock()
        self.stopped = threading.Event()

    def sample(self) -> None:
        now = memory_now()
        with self.lock:
            self.peak = {kind: max(self.peak[kind], now[kind]) for kind in MEMORY_KINDS}

    def peaks(self) -> dict[str, int]:
        """The peaks of the phase so far, this moment included."""
        self.sample()
        with self.lock:
            return dict(self.peak)

    def end_phase(self) -> dict[str, int]:
        """The peaks since the last call (or the start); the next phase's peaks start from what is held now."""
        with self.lock:
            peaks = self.peaks()
            self.peak = dict.fromkeys(MEMORY_KINDS, 0)
            self.sample()
        return peaks

    def run(self) -> None:
        written, wait_s = time.monotonic(), self.interval_s
        while not self.stopped.wait(wait_s):
            began = time.perf_counter()
            self.sample()
            # USS walks every page table entry of the process (the kernel's smaps): at 7B with the codes in shared
            # 4 KiB pages one sample took most of a core's time at 10 a second (perf: smaps_pte_range), so wait long
            # enough that sampling keeps within 1/SAMPLER_SHARE of a core
            wait_s = max(self.interval_s, (time.perf_counter() - began) * SAMPLER_SHARE)
            if self.running_file is not None and time.monotonic() - written > self.write_every_s:
                written = time.monotonic()
                write_json(self.running_file, {**self.peaks(), "at": time.time()})

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.sample()


def load_average() -> list[float]:
    """The machine's load average over 1, 5 and 15 minutes."""
    return [round(x, 2) for x in os.getloadavg()]


def meminfo_bytes(field: str) -> int:
    """A field of the machine's /proc/meminfo, in bytes (0 if absent)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def available_bytes() -> int:
    """The machine's ``MemAvailable``."""
    return meminfo_bytes("MemAvailable")


def machine() -> str:
    """The machine in a few words: cores and memory."""
    return f"{os.cpu_count()} CPU cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` gives it ("?" where it gives none): timings depend on it."""
    listing = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in listing.splitlines() if line.startswith("Model name:")), "?")


def tree_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (a sharded checkpoint)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------------------ page cache


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


# ------------------------------------------------------------------------------------------------ in a rank


def count_gathered_bytes(counter: dict[str, int]) -> None:
    """From now on, add the output bytes of every all-gather into a tensor made through ``deepspeed.comm`` to
    ``counter["bytes"]`` (what ZeRO-3 and the quantized gather move)."""
    import deepspeed.comm
    import deepspeed.comm.comm

    original = deepspeed.comm.comm.all_gather_into_tensor

    def counting(output_tensor: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        counter["bytes"] += output_tensor.numel() * output_tensor.element_size()
        return original(output_tensor, tensor, *args, **kwargs)

    deepspeed.comm.comm.all_gather_into_tensor = counting
    deepspeed.comm.all_gather_into_tensor = counting


def snapshot(module: Any, names: list[str]) -> dict[str, Any]:
    """Full copies of ``module``'s named params, gathered from their ZeRO-3 shards when partitioned (a collective:
    every rank calls it)."""
    import deepspeed

    params = dict(module.named_parameters())
    wanted = [params[name] for name in names]
    with deepspeed.zero.GatheredParameters(wanted):
        return {name: params[name].detach().clone() for name in names}


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) each thread of this process has used so far, by ``name[tid]``."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                text = stat.read()
        except OSError:  # the thread ended meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()
        used[f"{text[text.index('(') + 1 : text.rindex(')')]}[{tid}]"] = (int(fields[11]) + int(fields[12])) / tick
    return used


CANARY_KINDS = {"small": (4, 512, 8), "large": (64, 1024, 1)}  # copy MiB, matmul side, repeats of each


class MachineCanary:
    """Fixed work timed between steps, with the process otherwise quiet (OpenMP's threads given time to stop
    spinning): a single-thread copy, and an fp32 matmul on one thread and on all of torch's. A step that is slow while
    the canary is not points at the process; both slow, at the machine (a neighbour's memory traffic, two vCPUs on one
    core's hyperthreads) that the vCPUs' idle and steal time do not show.

    ``kind`` (:data:`CANARY_KINDS`): ``small`` (the default) copies 4 MiB and multiplies 512^3, 8 times each, so that
    it moves 12 MiB; ``large``, a 64 MiB copy and a 1024^3 matmul once, was suspected of slowing the step after it, and
    side by side neither changed the next step by more than 1% (docs/internals.md, "Steadiness of a step")."""

    QUIET_S = 0.05

    def __init__(self, kind: str = "small") -> None:
        import numpy
        import torch

        mib, self.side, self.repeats = CANARY_KINDS[kind]
        self.kind = kind
        self.source = numpy.ones(mib << 18, dtype=numpy.float32)
        self.target = numpy.empty_like(self.source)
        numpy.copyto(self.target, self.source)  # its pages faulted in here, not in the first sample
        self.a, self.b = torch.ones(self.side, self.side), torch.ones(self.side, self.side)

    def sample(self) -> dict[str, Any]:
        """``kind``; ``copy_gib_s``; ``mm_1t_gflops`` and ``mm_gflops`` (all threads); ``threads_worth``: how many
        single threads the all-thread matmul was worth (2 cores that are cores: near 2). Each rate is over all the
        repeats."""
        import numpy
        import torch

        time.sleep(self.QUIET_S)
        began = time.perf_counter()
        for _ in range(self.repeats):
            numpy.copyto(self.target, self.source)
        copy = 2 * self.source.nbytes * self.repeats / (time.perf_counter() - began) / 2**30
        threads = torch.get_num_threads()
        rates = []
        for use in (1, threads):
            torch.set_num_threads(use)
            torch.mm(self.a, self.b)  # the team of this size started
            began = time.perf_counter()
            for _ in range(self.repeats):
                torch.mm(self.a, self.b)
            rates.append(2 * self.side**3 * self.repeats / (time.perf_counter() - began) / 1e9)
        torch.set_num_threads(threads)
        return dict(
            kind=self.kind,
            copy_gib_s=round(copy, 2),
            mm_1t_gflops=round(rates[0], 1),
            mm_gflops=round(rates[1], 1),
            threads_worth=round(rates[1] / rates[0], 2),
        )


def add_canary_option(parser: Any) -> None:
    """``--canary KIND...`` on an ``argparse`` parser: the kinds a :class:`CanaryCycle` runs after successive steps."""
    parser.add_argument(
        "--canary",
        nargs="+",
        choices=(*CANARY_KINDS, "none"),
        default=["small"],
        help="the canary after each step, in turn (e.g. none small large: its cost to the next step, side by side)",
    )


class CanaryCycle:
    """The canaries run after successive steps, in turn: ``kinds`` of :data:`CANARY_KINDS`, or ``none`` (no canary:
    a step after it shows what the canary costs the next step, side by side in one process)."""

    def __init__(self, kinds: Sequence[str] = ("small",)) -> None:
        self.kinds = list(kinds)
        self.canaries = {kind: MachineCanary(kind) for kind in set(self.kinds) - {"none"}}
        self.ran = 0

    def sample(self) -> dict[str, Any]:
        """The next canary's figures (``{"kind": "none"}`` where the cycle says none)."""
        kind = self.kinds[self.ran % len(self.kinds)]
        self.ran += 1
        return self.canaries[kind].sample() if kind != "none" else {"kind": "none"}
