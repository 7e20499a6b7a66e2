"""Train the tiny Llama's LoRA adapters ``x``, ``y``, ``z`` at once and each alone, on N CPU processes, and resume the
run of all three from its first epoch; each run saves ``<out>/<run>.ckpt`` for the test to compare.

Lightning's launcher starts the other ranks by running this file again; one process pair serves every run. The
models are built in ``configure_model``, under ``zero.Init``, as large bases are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.adapter_models import FIT, CausalAdapters, token_batches  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402

NAMES = ["x", "y", "z"]


def fit(module: Any, devices: int, path: Path, resume: Optional[Path] = None, **kwargs: Any) -> None:
    trainer = cpu_trainer(devices=devices, **{**FIT, **kwargs})
    trainer.fit(module, token_batches(), ckpt_path=resume)
    trainer.save_checkpoint(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out, devices = Path(args.out), args.devices

    def module(names: list[str], together: bool = True) -> CausalAdapters:
        return CausalAdapters(args.llama, names, together=together, in_configure_model=True)

    fit(module(NAMES), devices, out / "together.ckpt")
    for name in NAMES:
        fit(module([name], together=False), devices, out / f"alone_{name}.ckpt")
    fit(module(NAMES), devices, out / "half.ckpt", max_epochs=1)
    fit(module(NAMES), devices, out / "resumed.ckpt", resume=out / "half.ckpt")


if __name__ == "__main__":
    main()
