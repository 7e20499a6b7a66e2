"""Fit LoRA on a tiny Llama folder ``--fits`` times in one process with the code cache at ``--cache``, on
``--devices`` ranks; after each fit, write what each rank saw: how many positioned reads of the folder's files the
fit made (the sliced loader's only reads), the frozen shards' codes and whether they are the folder's values
quantized, the fingerprint, the trained LoRA weights, how many frozen params read every rank's codes from a mapped
file, the anonymous and resident kB of this process's mappings of the cache's files, and the package's log lines.

    python code_cache_fit.py --folder F --cache C --out OUT [--devices 2] [--fits 2] [--frozen-dtype nf4]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from lightning_frozen.zero import frozen_files  # noqa: E402
from lightning_frozen.zero import params as zero  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import PretrainedLoRA, held_frozen, token_data  # noqa: E402


class SeededLoRA(PretrainedLoRA):
    """LoRA initialised from one seed whatever the load consumed of the generator before it."""

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model

        base = self.load_base()
        torch.manual_seed(7)
        self.model = get_peft_model(base, LoraConfig(r=4, target_modules=self.lora_targets))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def cache_mappings(cache: Path) -> dict[str, int]:
    """kB of this process's mappings of files in ``cache``: resident, and anonymous (pages copied on a write)."""
    found = {"rss": 0, "anonymous": 0, "mappings": 0}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = len(fields) >= 6 and fields[5].startswith(str(cache))
            found["mappings"] += inside
        elif inside and fields[0] in ("Rss:", "Anonymous:"):
            found[fields[0].rstrip(":").lower()] += int(fields[1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--fits", type=int, default=2)
    parser.add_argument("--frozen-dtype", default="nf4")
    args = parser.parse_args()
    frozen_dtype = None if args.frozen_dtype == "none" else args.frozen_dtype
    reads = [0]
    preadv = os.preadv

    def counting(*arguments: Any) -> int:
        reads[0] += 1
        return preadv(*arguments)

    os.preadv = counting
    lines = Lines()
    for name in ("lightning_frozen", "lightning.pytorch"):
        logging.getLogger(name).addHandler(lines)
    for fit in range(args.fits):
        reads[0], lines.lines = 0, []
        L.seed_everything(0)
        model = SeededLoRA(args.folder)
        strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype, code_cache=args.cache)
        trainer = cpu_trainer(strategy, devices=args.devices, max_steps=2, precision="bf16-true")
        trainer.fit(model, token_data())
        frozen = [p for p in model.parameters() if not p.requires_grad]
        held = held_frozen(model) if frozen_dtype is not None else {}
        held.pop("lora_b", None)  # tensors; the trained weights below hold them
        report = {
            "reads": reads[0],
            "held": held,
            "trained": {n: zero.full_param(p).float().tolist() for n, p in model.named_parameters() if p.requires_grad},
            "shared": sum(frozen_files.rows_of(p) is not None for p in frozen),
            "frozen": len(frozen),
            "mappings": cache_mappings(Path(args.cache).resolve()),
            "lines": [line for line in lines.lines if "code cache" in line],
            "files": sorted(path.name for path in Path(args.cache).glob("*.codes")),
        }
        write_report(Path(args.out) / f"fit{fit}", trainer.global_rank, report)


if __name__ == "__main__":
    main()
