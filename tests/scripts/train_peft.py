"""Train one of ``tests.peft_models.TUNERS`` under ``frozen_deepspeed`` on N CPU processes and save a checkpoint;
the tests run it as a script (Lightning's launcher starts the other ranks by running this file again)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.models import cpu_trainer  # noqa: E402
from tests.peft_models import PeftModule, batches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tuner", required=True)
    parser.add_argument("--llama", help="the tiny Llama's folder, for the tuners that train it")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--save", required=True)
    args = parser.parse_args()
    trainer = cpu_trainer(devices=args.devices, max_epochs=2)
    trainer.fit(PeftModule(args.tuner, args.llama), batches(args.tuner))
    trainer.save_checkpoint(args.save)


if __name__ == "__main__":
    main()
