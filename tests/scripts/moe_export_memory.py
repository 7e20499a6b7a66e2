"""Export ``--checkpoint`` merged twice (the first warms the process: imports, transformers' model classes), and print
as JSON how far the process's resident memory rose over its start during the second, sampled every millisecond."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning_frozen  # noqa: E402
from lightning_frozen.checkpoint import merged_export  # noqa: E402


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    merged_export.WRITE_AHEAD_BYTES = 0  # a write waits for the one before it: what is held is the merge's own
    lightning_frozen.export_merged(args.checkpoint, args.out / "warm")
    before, peak, done = resident(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], resident())

    sampler = threading.Thread(target=sample)
    sampler.start()
    lightning_frozen.export_merged(args.checkpoint, args.out / "measured")
    done.set()
    sampler.join()
    print(json.dumps({"peak_rise_mib": max(peak[0] - before, 0) / 2**20}))


if __name__ == "__main__":
    main()
