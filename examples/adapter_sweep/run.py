"""Several LoRA adapters trained at once on one frozen base, end to end, offline, on two CPU cores:

1. fit the sweep of ``config.yaml`` (three adapters of all-MiniLM-L6-v2, each its own rank, learning rate and
   warm-up, gradients clipped per adapter) through the lightning-frozen CLI; one ModelCheckpoint per adapter
   keeps that adapter's best epoch;
2. print each adapter's best validation accuracy and pick the best adapter of the sweep;
3. export that adapter alone to PEFT's format;
4. reload it twice, with ``lightning_frozen.load_from_checkpoint(..., adapter=name)`` and with
   ``peft.PeftModel.from_pretrained``, and check that both give the same logits.

    python examples/adapter_sweep/run.py [--out DIR] [CLI overrides such as --trainer.max_epochs=1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The config's class_paths (examples.*.task.*) import from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import lightning_frozen  # noqa: E402
from examples.adapter_sweep.task import SentimentSweep  # noqa: E402
from examples.common import fit_with_cli, say  # noqa: E402
from examples.minilm_lora.task import SentimentData, load_base_classifier  # noqa: E402

EXAMPLE = "adapter_sweep"
CONFIG = Path(__file__).with_name("config.yaml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs", EXAMPLE), help="where runs and exports go")
    options, overrides = parser.parse_known_args()
    started = time.monotonic()

    cli = fit_with_cli(EXAMPLE, CONFIG, options.out, overrides, step="1/4 fit every adapter at once")

    say(EXAMPLE, "2/4 each adapter's best epoch, by its own validation accuracy")
    best: dict[str, tuple[float, Path]] = {}
    for callback in cli.trainer.checkpoint_callbacks:
        name = callback.monitor.split("/", 1)[1]
        best[name] = (float(callback.best_model_score), Path(callback.best_model_path))
        print(f"{name:>12}: val_acc {best[name][0]:.3f}  {best[name][1]}")
    winner = max(best, key=lambda name: best[name][0])
    print(f"best adapter of the sweep: {winner}")

    say(EXAMPLE, f"3/4 export `{winner}` alone to PEFT")
    checkpoint = best[winner][1]
    peft_dir = lightning_frozen.export_peft_adapter(checkpoint, options.out / "peft_adapter", adapter=winner)
    for file in sorted(peft_dir.iterdir()):
        print(f"{file}  {file.stat().st_size:,} bytes")

    say(EXAMPLE, "4/4 reload: lightning_frozen.load_from_checkpoint(adapter=...) vs peft.PeftModel.from_pretrained")
    from peft import PeftModel

    module = lightning_frozen.load_from_checkpoint(SentimentSweep, checkpoint, adapter=winner)
    peft_model = PeftModel.from_pretrained(load_base_classifier(), str(peft_dir), adapter_name=winner).eval()
    data = SentimentData()
    data.setup("validate")
    input_ids, attention_mask, labels = data.datasets["val"].tensors
    with torch.no_grad():
        ours = module(input_ids, attention_mask)
        theirs = peft_model(input_ids=input_ids, attention_mask=attention_mask).logits
    difference = (ours - theirs).abs().max().item()
    accuracy = (ours.argmax(-1) == labels).float().mean().item()
    print(f"validation accuracy of `{winner}` reloaded alone: {accuracy:.3f} ({len(labels)} sentences)")
    print(f"max |logit difference| between the two reloads: {difference:.2e}")
    if not torch.allclose(ours, theirs, atol=1e-4):
        raise SystemExit(f"The PEFT export does not reproduce the checkpoint's logits (max difference {difference}).")
    say(EXAMPLE, f"done in {time.monotonic() - started:.0f} s; outputs under {options.out}")


if __name__ == "__main__":
    main()
