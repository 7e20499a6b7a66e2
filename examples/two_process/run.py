"""The MiniLM LoRA job on two CPU processes, then used in one process without DeepSpeed.

1. fit through the CLI with `trainer.devices: 2` (`lightning-frozen fit --config examples/two_process/config.yaml`);
   Lightning starts rank 1 by re-running this script, and each rank holds half of the frozen base's shards;
2. on rank 0: the checkpoint is one file whatever the number of ranks, and it loads into a single process with
   `lightning_frozen.load_from_checkpoint`, giving the validation accuracy the two ranks measured.

    python examples/two_process/run.py [--out DIR] [CLI overrides such as --trainer.limit_train_batches=4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The config's class_paths (examples.minilm_lora.task.*) import from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import lightning_frozen  # noqa: E402
from examples.common import best_checkpoint, fit_with_cli, say  # noqa: E402
from examples.minilm_lora.task import LoRASentimentClassifier, SentimentData  # noqa: E402
from lightning_frozen.memory import format_bytes  # noqa: E402

EXAMPLE = "two_process"
CONFIG = Path(__file__).with_name("config.yaml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs", EXAMPLE), help="where runs go")
    options, overrides = parser.parse_known_args()

    cli = fit_with_cli(EXAMPLE, CONFIG, options.out, overrides)
    if not cli.trainer.is_global_zero:
        return
    checkpoint = best_checkpoint(cli)
    callback = cli.trainer.checkpoint_callback

    say(EXAMPLE, "one checkpoint file from two ranks, loaded in one process without DeepSpeed")
    ranks = torch.load(checkpoint, weights_only=True)["lightning_frozen"]["world_size"]
    print(f"{checkpoint}: {format_bytes(checkpoint.stat().st_size)}, written by {ranks} ranks")
    module = lightning_frozen.load_from_checkpoint(LoRASentimentClassifier, checkpoint)
    data = SentimentData()
    data.setup("validate")
    input_ids, attention_mask, labels = data.datasets["val"].tensors
    with torch.no_grad():
        accuracy = (module(input_ids, attention_mask).argmax(-1) == labels).float().mean().item()
    print(f"validation accuracy: {accuracy:.3f} in one process, {float(callback.best_model_score):.3f} on two ranks")


if __name__ == "__main__":
    main()
