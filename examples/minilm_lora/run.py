"""The main example, end to end, on two CPU cores (the README gives a measured time):

1. fit a LoRA adapter on all-MiniLM-L6-v2 through the lightning-frozen CLI
   (`lightning-frozen fit --config examples/minilm_lora/config.yaml`), ModelCheckpoint keeping the best epoch;
2. compare the adapter checkpoint's size with the frozen base's, and print the strategy's memory summary;
3. export the checkpoint to PEFT's adapter format;
4. reload it twice, with `lightning_frozen.load_from_checkpoint` and with `peft.PeftModel.from_pretrained`,
   check that both give the same logits, print the reloaded adapter's validation accuracy and classify new
   sentences.

    python examples/minilm_lora/run.py [--out DIR] [CLI overrides such as --trainer.max_epochs=1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The config's class_paths (examples.minilm_lora.task.*) import from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import lightning_frozen  # noqa: E402
from examples.common import best_checkpoint, fit_with_cli, say  # noqa: E402
from examples.minilm_lora.task import (  # noqa: E402
    LABELS,
    LoRASentimentClassifier,
    SentimentData,
    load_base_classifier,
)
from lightning_frozen.memory import format_bytes  # noqa: E402

EXAMPLE = "minilm_lora"
CONFIG = Path(__file__).with_name("config.yaml")
NEW_SENTENCES = [
    "The soup was cold and the staff ignored us all night.",
    "What a lovely little bakery, I will definitely come back.",
    "The battery died after an hour and support never answered.",
    "Honestly one of the most beautiful films I have ever seen.",
]


def _logits(model: torch.nn.Module, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs", EXAMPLE), help="where runs and exports go")
    options, overrides = parser.parse_known_args()
    started = time.monotonic()

    cli = fit_with_cli(EXAMPLE, CONFIG, options.out, overrides, step="1/4 fit")
    checkpoint = best_checkpoint(cli)
    callback = cli.trainer.checkpoint_callback
    print(f"best {callback.monitor} {float(callback.best_model_score):.3f}: {checkpoint}")

    say(EXAMPLE, "2/4 sizes: the adapter checkpoint beside the frozen base, and memory per rank during fit")
    module = lightning_frozen.load_from_checkpoint(LoRASentimentClassifier, checkpoint)
    frozen = [p for p in module.parameters() if not p.requires_grad]
    trainable = [p for p in module.parameters() if p.requires_grad]
    base_bytes = sum(p.numel() * p.element_size() for p in frozen)
    checkpoint_bytes = checkpoint.stat().st_size
    print(f"frozen base:        {sum(p.numel() for p in frozen):>12,} params  {format_bytes(base_bytes):>12}")
    print(
        f"adapter checkpoint: {sum(p.numel() for p in trainable):>12,} params  {format_bytes(checkpoint_bytes):>12}"
        f"  ({checkpoint_bytes / base_bytes:.2%} of the base: weights, AdamW state, loops)"
    )
    print(cli.trainer.strategy.memory_summary())

    say(EXAMPLE, "3/4 export to PEFT")
    peft_dir = lightning_frozen.export_peft_adapter(checkpoint, options.out / "peft_adapter")
    for file in sorted(peft_dir.iterdir()):
        print(f"{file}  {format_bytes(file.stat().st_size)}")

    say(EXAMPLE, "4/4 reload: lightning_frozen.load_from_checkpoint vs peft.PeftModel.from_pretrained")
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(load_base_classifier(), str(peft_dir)).eval()
    data = SentimentData()
    data.setup("validate")
    input_ids, attention_mask, labels = data.datasets["val"].tensors
    tokens = {"input_ids": input_ids, "attention_mask": attention_mask}
    ours = _logits(module, tokens)
    theirs = _logits(peft_model, tokens).logits
    difference = (ours - theirs).abs().max().item()
    accuracy = (ours.argmax(-1) == labels).float().mean().item()
    print(f"validation accuracy of the reloaded adapter: {accuracy:.3f} ({len(labels)} sentences)")
    print(f"max |logit difference| between the two reloads: {difference:.2e}")
    if not torch.allclose(ours, theirs, atol=1e-4):
        raise SystemExit(f"The PEFT export does not reproduce the checkpoint's logits (max difference {difference}).")
    new = data.encode(NEW_SENTENCES)
    for sentence, label in zip(NEW_SENTENCES, _logits(module, new).argmax(-1).tolist()):
        print(f"{LABELS[label]:>8}: {sentence}")
    say(EXAMPLE, f"done in {time.monotonic() - started:.0f} s; outputs under {options.out}")


if __name__ == "__main__":
    main()
