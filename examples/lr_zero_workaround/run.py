"""The `lr=0` workaround under frozen_deepspeed: what the strategy converts, shown on a MiniLM linear probe.

1. before fit: the backbone's params all require grad and sit in an AdamW group with lr=0;
2. fit through the CLI (`lightning-frozen fit --config examples/lr_zero_workaround/config.yaml`): the strategy
   logs "froze ... parameter tensors ... (the `lr=0` workaround)" and its memory summary;
3. after fit: the backbone is frozen, the checkpoint and its optimizer state hold only the head, and the
   checkpoint loads onto a freshly loaded backbone, which verifies that the backbone did not change.

    python examples/lr_zero_workaround/run.py [--out DIR] [CLI overrides such as --trainer.max_epochs=1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The config's class_paths (examples.*) import from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import lightning_frozen  # noqa: E402
from examples.common import best_checkpoint, fit_with_cli, say  # noqa: E402
from examples.lr_zero_workaround.probe import LinearProbe  # noqa: E402
from lightning_frozen.memory import format_bytes  # noqa: E402

EXAMPLE = "lr_zero_workaround"
CONFIG = Path(__file__).with_name("config.yaml")


def _requiring_grad(module: torch.nn.Module) -> str:
    params = list(module.parameters())
    return f"{sum(p.requires_grad for p in params)} of {len(params)} tensors require grad"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs", EXAMPLE), help="where runs go")
    options, overrides = parser.parse_known_args()

    say(EXAMPLE, "1/3 the module as written")
    module = LinearProbe()
    for group in module.configure_optimizers().param_groups:
        print(f"AdamW group lr={group['lr']}: {sum(p.numel() for p in group['params']):,} elements")
    print(f"backbone: {_requiring_grad(module.backbone)}")
    del module

    cli = fit_with_cli(EXAMPLE, CONFIG, options.out, overrides, step="2/3 fit")
    checkpoint = best_checkpoint(cli)

    say(EXAMPLE, "3/3 what the strategy did with the lr=0 group")
    print(f"backbone after fit: {_requiring_grad(cli.model.backbone)}")
    saved = torch.load(checkpoint, weights_only=True)
    print(f"checkpoint {checkpoint}: {format_bytes(checkpoint.stat().st_size)}")
    print(f"  state_dict: {sorted(saved['state_dict'])}")
    print(f"  optimizer state for: {sorted(saved['optimizer_states'][0]['state'])}")
    lightning_frozen.load_from_checkpoint(LinearProbe, checkpoint)
    print("load_from_checkpoint onto a freshly loaded backbone verified the frozen base: the backbone is unchanged")


if __name__ == "__main__":
    main()
