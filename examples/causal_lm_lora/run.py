"""LoRA on a causal LM loaded in ``configure_model``, end to end, on two CPU processes (docs/large-models.md gives a
measured time):

1. write the frozen base: a small Llama-architecture model with random weights, saved with ``save_pretrained``
   (a stand-in for a hub checkpoint: nothing is downloaded);
2. fit a LoRA adapter through the lightning-frozen CLI on 2 ranks
   (`lightning-frozen fit --config examples/causal_lm_lora/config.yaml`): ``configure_model`` calls
   ``AutoModelForCausalLM.from_pretrained`` and ``get_peft_model``, each rank loading only its half of the base;
3. export the adapter checkpoint to PEFT's format;
4. reload it twice, with ``lightning_frozen.load_from_checkpoint`` (which calls ``configure_model``) and with
   ``peft.PeftModel.from_pretrained``, check that both give the same logits and the same greedy generation, and
   print what the base and the adapter generate from a prompt.

    python examples/causal_lm_lora/run.py [--out DIR] [CLI overrides such as --trainer.max_epochs=1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# The config's class_paths (examples.causal_lm_lora.task.*) import from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import lightning_frozen  # noqa: E402
from examples.causal_lm_lora.make_base import write_base  # noqa: E402
from examples.causal_lm_lora.task import CausalLoRA, load_base  # noqa: E402
from examples.common import best_checkpoint, fit_with_cli, say  # noqa: E402
from lightning_frozen.memory import format_bytes  # noqa: E402

EXAMPLE = "causal_lm_lora"
CONFIG = Path(__file__).with_name("config.yaml")
PROMPT = [7, 10, 13, 16]
NEW_TOKENS = 8


def _generate(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        ids = model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return ids[0, len(PROMPT) :].tolist()


def _val_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids).loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=Path("outputs", EXAMPLE), help="where the base, runs and exports go"
    )
    options, overrides = parser.parse_known_args()
    started = time.monotonic()
    base_dir = options.out / "base"

    # Lightning starts rank 1 by re-running this script once rank 0 is in fit: the base is written by then
    if os.environ.get("LOCAL_RANK", "0") == "0":
        say(EXAMPLE, "1/4 the frozen base: a random-weight Llama written with save_pretrained")
        write_base(base_dir)
        for file in sorted(base_dir.iterdir()):
            print(f"{file}  {format_bytes(file.stat().st_size)}")

    cli = fit_with_cli(EXAMPLE, CONFIG, options.out, [f"--model.init_args.base_dir={base_dir}", *overrides], "2/4 fit")
    if not cli.trainer.is_global_zero:
        return
    checkpoint = best_checkpoint(cli)
    print(f"best val_loss {float(cli.trainer.checkpoint_callback.best_model_score):.3f}: {checkpoint}")
    print(f"adapter checkpoint: {format_bytes(checkpoint.stat().st_size)}")
    print(cli.trainer.strategy.memory_summary())

    say(EXAMPLE, "3/4 export to PEFT")
    peft_dir = lightning_frozen.export_peft_adapter(checkpoint, options.out / "peft_adapter")
    for file in sorted(peft_dir.iterdir()):
        print(f"{file}  {format_bytes(file.stat().st_size)}")

    say(EXAMPLE, "4/4 reload: lightning_frozen.load_from_checkpoint vs peft.PeftModel.from_pretrained")
    from peft import PeftModel

    ours = lightning_frozen.load_from_checkpoint(CausalLoRA, checkpoint).model.eval()
    theirs = PeftModel.from_pretrained(load_base(str(base_dir)), str(peft_dir)).eval()
    data = cli.datamodule
    val = data.sequences("val")
    with torch.no_grad():
        difference = (ours(input_ids=val).logits - theirs(input_ids=val).logits).abs().max().item()
    print(f"max |logit difference| between the two reloads: {difference:.2e}")
    if difference > 1e-4:
        raise SystemExit(f"The PEFT export does not reproduce the checkpoint's logits (max difference {difference}).")
    print(f"validation loss: base {_val_loss(load_base(str(base_dir)), val):.3f}, adapter {_val_loss(ours, val):.3f}")
    generated = _generate(ours)
    if _generate(theirs) != generated:
        raise SystemExit("The two reloads generate different tokens from the same prompt.")
    rule = [(PROMPT[-1] + data.hparams.step * (i + 1)) % data.hparams.vocab_size for i in range(NEW_TOKENS)]
    print(f"prompt:              {PROMPT}")
    print(f"base generates:      {_generate(load_base(str(base_dir)).eval())}")
    print(f"adapter generates:   {generated} (both reloads)")
    print(f"the rule continues:  {rule}")
    say(EXAMPLE, f"done in {time.monotonic() - started:.0f} s; outputs under {options.out}")


if __name__ == "__main__":
    main()
