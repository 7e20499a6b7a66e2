"""What torch's OpenMP team burns while it waits between ops: libgomp's own spinning, the package's brief waits
(``zero/compute/waiting_threads.py``), and libgomp's own again after them.

    python benchmarks/waiting_threads/run.py [--cycles 30] [--gap-ms 20]

Each figure is the CPU seconds torch's team (every thread but the main one) uses over ``--cycles`` of one parallel op
followed by a pause of ``--gap-ms`` on the main thread: the op's own share is a fraction of a millisecond, the rest is
the team waiting for the next op. torch runs on as many threads as the process may use CPUs, as the waits need. The
figures swing with other processes on the cores, so they are a benchmark, not a test (``tests/test_waiting_threads.py``
checks the mechanism: the parked team, and its end). Prints one markdown row with the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness.probes import load_average  # noqa: E402
from lightning_frozen.zero.compute import waiting_threads  # noqa: E402


def others_cpu_s() -> float:
    """CPU seconds (nanosecond clock, /proc's schedstat) used so far by this process's threads other than this one."""
    own, total = threading.get_native_id(), 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != own:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as stat:
                    total += int(stat.read().split()[0])
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
    return total / 1e9


def waiting_cpu_s(cycles: int, gap_s: float) -> float:
    """CPU seconds the team uses over ``cycles`` of a parallel op of torch's followed by a pause of this thread."""
    values = torch.ones(1 << 21)
    torch.add(values, 1)  # the team exists before the count starts
    before = others_cpu_s()
    for _ in range(cycles):
        torch.add(values, 1)
        time.sleep(gap_s)
    return others_cpu_s() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    gap_s = args.gap_ms / 1e3
    spinning = waiting_cpu_s(args.cycles, gap_s)
    waits = waiting_threads.for_this_process()
    if waits is None:
        sys.exit("the package leaves these waits alone here (one CPU, a wait policy of the user's, no libgomp alone)")
    brief = waiting_cpu_s(args.cycles, gap_s)
    waits.close()
    after = waiting_cpu_s(args.cycles, gap_s)
    print(f"| waits of {args.gap_ms:g} ms | spinning | brief | spinning again | load average |")
    print("|---|---|---|---|---|")
    load = " ".join(f"{value:.2f}" for value in load_average())
    print(f"| {args.cycles} | {spinning:.3f} s | {brief:.3f} s | {after:.3f} s | {load} |")


if __name__ == "__main__":
    main()
