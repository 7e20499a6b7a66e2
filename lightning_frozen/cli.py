"""The ``lightning-frozen`` command: Lightning's CLI with the frozen strategies registered, plus ``convert``.

``lightning-frozen fit --config config.yaml`` is :class:`~lightning.pytorch.cli.LightningCLI` in subclass mode
(any LightningModule and LightningDataModule named by ``class_path``), with ``frozen_deepspeed`` as the default
strategy. ``lightning-frozen convert SRC_DIR DST_FILE`` turns a stock Lightning DeepSpeed checkpoint directory
into a lightning-frozen checkpoint file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.cli import ArgsType, LightningCLI
from typing_extensions import override

import lightning_frozen
from lightning_frozen.errors import FrozenTrainingError
from lightning_frozen.memory import format_bytes
from lightning_frozen.zero.init import import_with_logs_to_stderr

PROG = "lightning-frozen"

_DESCRIPTION = f"""\
Lightning's CLI with the lightning-frozen strategies registered: trainer.strategy defaults to frozen_deepspeed
and accepts frozen_deepspeed_offload, frozen_deepspeed_no_offload or `class_path:
lightning_frozen.FrozenAwareDeepSpeedStrategy` with `init_args`. On the command line, strategy options need the
class form: `--trainer.strategy=FrozenAwareDeepSpeedStrategy --trainer.strategy.offload_frozen=false` (a class
name with no option after it is read as a registered name, and fails); `--trainer.strategy.help
FrozenAwareDeepSpeedStrategy` lists the options. Also: `{PROG} convert SRC_DIR DST_FILE` converts a stock
Lightning DeepSpeed checkpoint directory (`{PROG} convert --help`)."""


class _FrozenCLI(LightningCLI):
    """LightningCLI that reports a :class:`~lightning_frozen.FrozenTrainingError` raised while it builds the classes
    (a strategy argument refused) as one line and exit status 2, as jsonargparse reports a type error, instead of
    chained tracebacks ending in the whole parsed config."""

    @override
    def instantiate_classes(self) -> None:
        refused: list[FrozenTrainingError] = []
        # a class in a union (the Trainer's `strategy: str | Strategy`) fails chained to the first subtype's error,
        # not to ours, so ours are recorded as they are raised
        self.parser.add_instantiator(partial(_instantiate_recording, refused), object)
        try:
            super().instantiate_classes()
        except Exception as error:
            ours = [cause for cause in _chain(error) if isinstance(cause, FrozenTrainingError)] + refused
            if not ours:
                raise  # anything else (a bug in the user's class) keeps its traceback
            self.parser.exit(2, f"{PROG}: error: {ours[0]}\n")


def _instantiate_recording(refused: list[FrozenTrainingError], class_type: type, *args: Any, **kwargs: Any) -> Any:
    try:
        return class_type(*args, **kwargs)
    except FrozenTrainingError as error:
        refused.append(error)
        raise


def _chain(error: Optional[BaseException]) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling, innermost last."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def lightning_cli(args: ArgsType = None, **kwargs: Any) -> LightningCLI:
    """Build (and by default run) the ``lightning-frozen`` LightningCLI and return it.

    ``args`` are parsed as LightningCLI parses them (``None`` reads ``sys.argv``). ``kwargs`` go to
    :class:`~lightning.pytorch.cli.LightningCLI` and override this command's defaults: subclass mode for model
    and data, ``trainer.strategy="frozen_deepspeed"``. A :class:`~lightning_frozen.FrozenTrainingError` raised while
    the classes are built (a refused strategy argument) prints as one line and exits with status 2.
    """
    options: dict[str, Any] = {
        "model_class": None,
        "datamodule_class": None,
        "subclass_mode_model": True,
        "subclass_mode_data": True,
        "trainer_defaults": {"strategy": "frozen_deepspeed"},
        "parser_kwargs": {"prog": PROG, "description": _DESCRIPTION},
        "args": args,
    }
    options.update(kwargs)
    return _FrozenCLI(**options)


def _convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} convert",
        description=(
            "Convert a checkpoint directory written by Lightning's stock DeepSpeedStrategy (ZeRO-3) into one"
            " lightning-frozen checkpoint file: trainable state and optimizer state by name, plus the frozen base's"
            " fingerprint when the directory holds the frozen weights. `lightning_frozen.load_adapter`,"
            " `load_from_checkpoint`, `export_peft_adapter` and `fit(ckpt_path=...)` under frozen_deepspeed read it."
        ),
    )
    parser.add_argument("src_dir", type=Path, help="checkpoint directory written by DeepSpeedStrategy")
    parser.add_argument("dst_file", type=Path, help="the lightning-frozen checkpoint file to write")
    parser.add_argument("--reference", help="where the frozen base comes from (a path or hub id), stored in the file")
    return parser


def convert(argv: list[str]) -> None:
    """Run ``lightning-frozen convert``: parse ``argv`` and call :func:`lightning_frozen.convert_deepspeed_checkpoint`.

    Exits with status 2 on bad arguments and 1, printing the reason, when the conversion raises a
    :class:`~lightning_frozen.FrozenTrainingError` or an ``OSError`` (a missing or unreadable source).
    """
    parser = _convert_parser()
    options = parser.parse_args(argv)
    try:
        written = lightning_frozen.convert_deepspeed_checkpoint(options.src_dir, options.dst_file, options.reference)
    except (FrozenTrainingError, OSError) as error:
        parser.exit(1, f"{PROG} convert: error: {error}\n")
    print(f"{PROG} convert: wrote {written} ({format_bytes(written.stat().st_size)}) from {options.src_dir}")


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``lightning-frozen`` console script; ``args`` default to ``sys.argv[1:]``.

    The current directory goes first on ``sys.path``, as with ``python -m``, so that a ``class_path`` naming a
    module of the project one runs from (``examples.minilm_lora.task.LoRASentimentClassifier``) imports.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    import_with_logs_to_stderr()  # DeepSpeed's log lines must stay out of `--print_config > config.yaml`
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["convert"]:
        convert(argv[1:])
    else:
        lightning_cli(args)
