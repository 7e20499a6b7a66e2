"""What the examples' ``run.py`` drivers share: fitting through the lightning-frozen CLI from a script."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from lightning_frozen.cli import lightning_cli


def say(example: str, message: str) -> None:
    """Print a progress line of ``example``, once: not from the ranks Lightning starts by re-running the script."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"\n[{example}] {message}", flush=True)


def fit_with_cli(example: str, config: Path, out: Path, overrides: list[str], step: str = "fit") -> LightningCLI:
    """Run ``lightning-frozen fit --config config --trainer.default_root_dir=out *overrides`` in this process.

    Returns the CLI, whose ``trainer`` and ``model`` hold the fitted state. With ``trainer.devices > 1`` on the
    CPU, Lightning starts the other ranks by re-running the calling script with the same command line.
    """
    args = ["fit", "--config", str(config), f"--trainer.default_root_dir={out}", *overrides]
    say(example, f"{step}: lightning-frozen " + " ".join(args))
    # The driver forwards its own command line to the CLI on purpose.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    return lightning_cli(args)


def best_checkpoint(cli: LightningCLI) -> Path:
    """The checkpoint ModelCheckpoint kept as best (or, without a monitored metric, the last one it wrote).

    Raises:
        SystemExit: no checkpoint was written (no ModelCheckpoint, or validation never ran).
    """
    callback = cli.trainer.checkpoint_callback
    path = callback.best_model_path if callback is not None else ""
    if not path:
        raise SystemExit("No checkpoint was written: keep ModelCheckpoint in the config and let an epoch finish.")
    return Path(path)
