"""Write a file of ``--tensors`` fp32 tensors of ``--mib`` MiB each in two passes (``zero/torch_file.py``), each value
made only when it is put and dropped after; print as JSON how far the process's peak resident memory rose meanwhile."""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen.zero import torch_file  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    later = [torch.empty(args.mib << 18, device="meta") for _ in range(args.tensors)]
    torch.save({"warm": torch.ones(3)}, args.out)  # torch's own first-call costs, before the peak is read
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def fill(put: torch_file.Put) -> None:
        for index, tensor in enumerate(later):
            put(tensor, torch.full(tensor.shape, float(index)))

    with open(args.out, "w+b") as handle:
        torch_file.save_in_two_passes({"state_dict": dict(enumerate(later))}, handle, later, fill)
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB on Linux
    print(json.dumps({"peak_rise_mib": rise}))


if __name__ == "__main__":
    main()
