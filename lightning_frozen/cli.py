"""The ``lightning-frozen`` command: Lightning's CLI with the frozen strategies registered, and the steps after a fit.

``lightning-frozen fit --config config.yaml`` (and ``validate``, ``test``, ``predict``) is
:class:`~lightning.pytorch.cli.LightningCLI` in subclass mode (any LightningModule and LightningDataModule named by
``class_path``), with ``frozen_deepspeed`` as the default strategy. The steps after a fit are :data:`STEPS`:
``export-peft`` (PEFT's adapter format), ``convert`` (a stock Lightning DeepSpeed checkpoint directory into a
lightning-frozen file) and ``estimate`` (memory per rank, from a model's config or a LightningCLI config).
"""

from __future__ import annotations

import argparse
import json
import os
import pkgutil
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

import lightning_frozen
from lightning_frozen import arguments
from lightning_frozen.base import code_cache
from lightning_frozen.checkpoint import convert
from lightning_frozen.errors import FrozenTrainingError, InvalidArgumentValueError
from lightning_frozen.hf import reference
from lightning_frozen.memory import experts_of, format_bytes

PROG = "lightning-frozen"

_DESCRIPTION = """\
Lightning's CLI with the lightning-frozen strategies registered: trainer.strategy defaults to frozen_deepspeed
and accepts frozen_deepspeed_offload, frozen_deepspeed_no_offload or `class_path:
lightning_frozen.FrozenAwareDeepSpeedStrategy` with `init_args`. A strategy option on the command line
(`--trainer.strategy.frozen_dtype=nf4`) applies to the registered name the config gives, as its class with that
name's options; `--trainer.strategy.help FrozenAwareDeepSpeedStrategy` lists the options."""


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


class _CommandLineCLI(_FrozenCLI):
    """The console script's CLI. Its ``args`` are the command line it read (a strategy name turned into its class), so
    Lightning's warning for ``args`` given beside a command line, meant for calls from Python, does not apply."""

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
            super().parse_arguments(parser, args)

    @override
    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        if isinstance(self.trainer.strategy, lightning_frozen.FrozenAwareDeepSpeedStrategy):
            self.trainer.strategy.run_from_command_line = True  # its advice after fit names this command's steps


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


def lightning_cli(args: ArgsType = None, *, from_command_line: bool = False, **kwargs: Any) -> LightningCLI:
    """Build (and by default run) the ``lightning-frozen`` LightningCLI and return it.

    ``args`` are parsed as LightningCLI parses them (``None`` reads ``sys.argv``). ``kwargs`` go to
    :class:`~lightning.pytorch.cli.LightningCLI` and override this command's defaults: subclass mode for model
    and data, ``trainer.strategy="frozen_deepspeed"``. A :class:`~lightning_frozen.FrozenTrainingError` raised while
    the classes are built (a refused strategy argument) prints as one line and exits with status 2.
    ``from_command_line``: ``args`` are the process's command line (the console script's), not a call's own.
    """
    options: dict[str, Any] = {
        "model_class": None,
        "datamodule_class": None,
        "subclass_mode_model": True,
        "subclass_mode_data": True,
        "trainer_defaults": {"strategy": "frozen_deepspeed"},
        "parser_kwargs": {"prog": PROG, "description": _DESCRIPTION, "epilog": _steps_epilog()},
        "args": args,
    }
    options.update(kwargs)
    return (_CommandLineCLI if from_command_line else _FrozenCLI)(**options)


@dataclass(frozen=True)
class Step:
    """A subcommand for a step after ``fit``: one line on what it does, the arguments it takes, and the call that does
    it, which returns what it prints. A new step is an entry of :data:`STEPS`."""

    summary: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], str]


def _export_peft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_path", type=Path, help="a lightning-frozen checkpoint file of a PEFT model")
    parser.add_argument("output_dir", type=Path, help="the folder to write (replaced only if it holds an export)")
    parser.add_argument("--adapter", help="of a run that trained several adapters at once, the one to export")


def _export_peft(options: argparse.Namespace) -> str:
    written = lightning_frozen.export_peft_adapter(options.checkpoint_path, options.output_dir, options.adapter)
    return f"wrote {written} (load it with `peft.PeftModel.from_pretrained(base, {str(written)!r})`)"


def _export_merged_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_path", type=Path, help="a lightning-frozen checkpoint file of a PEFT model")
    parser.add_argument("output_dir", type=Path, help="the folder to write (replaced only if it holds such an export)")
    parser.add_argument("--adapter", help="of a run that trained several adapters at once, the one to merge")
    parser.add_argument("--dtype", help="the weights' dtype, e.g. bfloat16 (default: the base's)")
    parser.add_argument("--max-shard-size", default="5GB", help="the largest safetensors shard (default: 5GB)")
    parser.add_argument("--base", type=Path, help="the base's folder, where it moved since training")


def _export_merged(options: argparse.Namespace) -> str:
    written = lightning_frozen.export_merged(**vars(options))  # the options are named as its parameters
    return f"wrote {written} (load it with `AutoModel*.from_pretrained({str(written)!r})`)"


def _cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, help=f"the cache's folder (default: ${code_cache.ENVIRONMENT} or ~/.cache)")
    parser.add_argument(
        "--verify", action="store_true", help="read each file whole: its rows' CRCs, its folder's files"
    )
    parser.add_argument("--clear", action="store_true", help="remove every file of the cache")


def _cache(options: argparse.Namespace) -> str:
    found = code_cache.entries(options.dir)
    total = format_bytes(sum(size for _, size, _ in found))
    if options.clear:
        for path, _, _ in found:
            path.unlink(missing_ok=True)
            path.with_suffix(".lock").unlink(missing_ok=True)
        return f"removed {len(found)} files ({total})"
    lines = [f"{len(found)} files, {total}"]
    for path, size, used in found:
        problems = code_cache.verify(path) if options.verify else []
        state = ": " + ("; ".join(problems) or "whole") if options.verify else ""
        lines.append(
            f"  {path} {format_bytes(size)}, last used {time.strftime('%Y-%m-%d %H:%M', time.localtime(used))}"
        )
        lines[-1] += state
    return "\n".join(lines)


def _convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src_dir", type=Path, help="checkpoint directory written by DeepSpeedStrategy")
    parser.add_argument("dst_file", type=Path, help="the lightning-frozen checkpoint file to write")
    parser.add_argument("--reference", help="where the frozen base comes from (a path or hub id), stored in the file")
    parser.add_argument(
        "--module",
        help="the LightningModule class it was trained from (package.module.Class), built from the hyper-parameters"
        " the directory saved: it records the base's reference and, for a PEFT model, what export-peft needs",
    )


def _convert(options: argparse.Namespace) -> str:
    module = None
    if options.module:
        module = convert.module_from_directory(options.src_dir, pkgutil.resolve_name(options.module))
    written = lightning_frozen.convert_deepspeed_checkpoint(
        options.src_dir, options.dst_file, options.reference, module=module
    )
    return f"wrote {written} ({format_bytes(written.stat().st_size)}) from {options.src_dir}"


DEFAULT_LORA_R = 8  # `estimate`'s adapter on a base given alone (a config.json, a folder, a hub id)


def _estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="a model's config.json, the folder holding it (a hub checkpoint), a hub id, or a LightningCLI config"
        " (.yaml) whose trainer and strategy settings are read and whose model is built on the meta device",
    )
    parser.add_argument("--base", help="with a .yaml source: the base's config.json or folder to build instead")
    parser.add_argument("--devices", type=int, help="ranks per node (default: the config's, else 1)")
    parser.add_argument("--num-nodes", type=int, help="nodes (default: the config's, else 1)")
    parser.add_argument("--precision", help="the Trainer's precision (default: the config's, else its default 32-true)")
    parser.add_argument("--frozen-dtype", help="int8, nf4, bf16 or fp16 (default: the config's, else None)")
    parser.add_argument("--lora-r", type=int, help=f"LoRA rank on a config.json's model (default: {DEFAULT_LORA_R})")
    parser.add_argument(
        "--target-modules", nargs="+", help="LoRA's target modules (default: PEFT's for the model type)"
    )
    parser.add_argument(
        "--target-parameters",
        nargs="+",
        help="LoRA's target parameters, as PEFT's `LoraConfig(target_parameters=...)`: a MoE's fused experts, such as"
        " mlp.experts.gate_up_proj mlp.experts.down_proj (default: none)",
    )


def _estimate(options: argparse.Namespace) -> str:
    settings: dict[str, Any] = {}
    if options.source.endswith((".yaml", ".yml")):
        settings = _cli_config_settings(Path(options.source))
    lora = ""
    if options.base or not settings:
        rank = options.lora_r or DEFAULT_LORA_R
        source, parameters = options.base or options.source, options.target_parameters
        model = reference.lora_model_on_meta(source, rank, options.target_modules, parameters)
        targets = (
            f"on {', '.join(options.target_modules)} (given)"
            if options.target_modules
            else "on PEFT's default modules for the model type (`--target-modules`)"
        )
        if parameters:
            targets += f" and on the parameters {', '.join(parameters)} (given)"
        elif experts_of(model)[0]:
            targets += ", its fused experts untouched (`--target-parameters`)"
        lora = f", LoRA r={rank} ({'given' if options.lora_r else '`--lora-r`, default'}) {targets}"
    else:
        model = _module_on_meta(settings["model"], Path(options.source))
    given = {"precision": options.precision, "frozen_dtype": options.frozen_dtype}
    given |= {"num_devices": options.devices, "num_nodes": options.num_nodes}
    assumed, origins = _assumptions(given, settings)
    estimate = lightning_frozen.estimate_memory(model, print_table=False, **assumed)
    said = ", ".join(f"{name} {assumed[name]!s} ({origins[name]})" for name in ("precision", "frozen_dtype"))
    return f"{options.source}: assumed {said}{lora}\n{estimate.table()}"


def _cli_config_settings(path: Path) -> dict[str, Any]:
    """What a LightningCLI config says that the estimate needs: the Trainer's precision, devices and nodes, the
    strategy's ``frozen_dtype`` and offloads (a registered name's, or its ``init_args``), and the model's entry."""
    config = yaml.safe_load(path.read_text()) or {}
    trainer = config.get("trainer") or {}
    strategy = trainer.get("strategy", "frozen_deepspeed")
    if isinstance(strategy, str) and strategy not in _OPTIONS_OF:
        raise InvalidArgumentValueError(
            f"{path}: `trainer.strategy: {strategy}` is not a lightning-frozen strategy; the estimate is for"
            f" {', '.join(_OPTIONS_OF)} or `lightning_frozen.FrozenAwareDeepSpeedStrategy`."
        )
    options = _OPTIONS_OF[strategy] if isinstance(strategy, str) else strategy.get("init_args") or {}
    settings = {"model": config.get("model")}
    settings |= {name: trainer[key] for key, name in _TRAINER_SETTINGS.items() if key in trainer}
    settings |= {key: options[key] for key in ("frozen_dtype", "offload_frozen", "offload_optimizer") if key in options}
    if not isinstance(settings.get("num_devices", 1), int):
        raise InvalidArgumentValueError(
            f"{path}: `trainer.devices: {settings['num_devices']}` is no number of devices; pass `--devices N`."
        )
    return settings


_OPTIONS_OF = {name: options for name, _, options in arguments.REGISTERED_NAMES}  # a registered name's arguments
_TRAINER_SETTINGS = {"precision": "precision", "devices": "num_devices", "num_nodes": "num_nodes"}
# what the estimate assumes where neither the command line nor the config says, and whose default it is
_DEFAULTS: dict[str, tuple[Any, str]] = {
    "precision": ("32-true", "the Trainer's default"),
    "frozen_dtype": (None, "the strategy's default"),
    "num_devices": (1, "the default"),
    "num_nodes": (1, "the default"),
}


def _assumptions(given: dict[str, Any], settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``estimate_memory``'s arguments, each from the command line, else the config, else its default; and where
    each of them came from."""
    assumed, origins = {}, {}
    for name, (default, whose) in _DEFAULTS.items():
        if given.get(name) is not None:
            assumed[name], origins[name] = given[name], "given"
        elif name in settings:
            assumed[name], origins[name] = settings[name], "the config's"
        else:
            assumed[name], origins[name] = default, whose
    assumed |= {key: settings[key] for key in ("offload_frozen", "offload_optimizer") if key in settings}
    return assumed, origins


def _module_on_meta(entry: Any, source: Path) -> torch.nn.Module:
    """The LightningModule a config's ``model`` entry names, built (``__init__``, then ``configure_model``) on the meta
    device.

    Raises:
        InvalidArgumentValueError: no ``class_path``, or the module loads weights (``from_pretrained`` refuses the
            meta device): the message says to pass ``--base``.
    """
    if not (isinstance(entry, dict) and "class_path" in entry):
        raise InvalidArgumentValueError(
            f"{source} has no `model: class_path:` entry: pass the base's config.json or folder with `--base`."
        )
    module_class = pkgutil.resolve_name(entry["class_path"])
    try:
        with torch.device("meta"):
            module = module_class(**(entry.get("init_args") or {}))
            if callable(getattr(module, "configure_model", None)):
                module.configure_model()
    except RuntimeError as error:
        if "meta" not in str(error):
            raise  # the module's own error
        raise InvalidArgumentValueError(
            f"`{module_class.__name__}` loads weights while it is built ({str(error).splitlines()[0]}), which the"
            " estimate does not do: pass its base's config.json or folder with `--base`; the config's trainer and"
            " strategy settings still apply."
        ) from error
    return module


STEPS: dict[str, Step] = {
    "export-peft": Step(
        "Export a lightning-frozen checkpoint of a PEFT model to PEFT's format: adapter_config.json and"
        " adapter_model.safetensors, for `peft.PeftModel.from_pretrained(base, OUTPUT_DIR)`.",
        _export_peft_arguments,
        _export_peft,
    ),
    "export-merged": Step(
        "Write a Hugging Face folder with the adapter merged into its base, for serving (vLLM, TGI, llama.cpp):"
        " safetensors shards, config.json and the base folder's tokenizer files, one tuner layer at a time.",
        _export_merged_arguments,
        _export_merged,
    ),
    "convert": Step(
        "Convert a checkpoint directory written by Lightning's stock DeepSpeedStrategy (ZeRO-3) into one"
        " lightning-frozen checkpoint file: trainable state and optimizer state by name, plus the frozen base's"
        " fingerprint when the directory holds the frozen weights. `lightning_frozen.load_adapter`,"
        " `load_from_checkpoint` and `fit(ckpt_path=...)` under frozen_deepspeed read it; `export-peft` reads it"
        " when `--module` named the class of a PEFT model.",
        _convert_arguments,
        _convert,
    ),
    "cache": Step(
        "List the code cache's files (the frozen bases later fits map instead of reading their folders), check them"
        " whole with --verify, or remove them with --clear.",
        _cache_arguments,
        _cache,
    ),
    "estimate": Step(
        "Estimate the per-rank memory of training a model under frozen_deepspeed, without allocating it (built on"
        " the meta device), and say the precision and frozen_dtype it assumed.",
        _estimate_arguments,
        _estimate,
    ),
}


def run_step(name: str, argv: list[str]) -> None:
    """Run the step ``name`` of :data:`STEPS` with ``argv`` and print what it returns.

    Exits with status 2 on bad arguments and 1, printing the reason, when the step raises a
    :class:`~lightning_frozen.FrozenTrainingError` or an ``OSError`` (a missing or unreadable file).
    """
    step = STEPS[name]
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=step.summary)
    step.arguments(parser)
    options = parser.parse_args(argv)
    try:
        printed = step.run(options)
    except (FrozenTrainingError, OSError) as error:
        parser.exit(1, f"{PROG} {name}: error: {error}\n")
    print(f"{PROG} {name}: {printed}")


def subcommands() -> list[str]:
    """Every subcommand of the command: Lightning's, then the steps after ``fit``."""
    return [*LightningCLI.subcommands(), *STEPS]


def _steps_epilog() -> str:
    return f"Steps after fit: {', '.join(STEPS)} (`{PROG} STEP --help` says what each does)."


def strategy_named_with_options(argv: list[str]) -> list[str]:
    """``argv`` with a registered strategy name turned into its class and that name's options where a
    ``--trainer.strategy.OPTION`` follows it: the name a ``--config`` file or ``--trainer.strategy=NAME`` gives (or the
    default, ``frozen_deepspeed``). The class goes before the first option, as ``--trainer.strategy=`` a class does;
    a ``class_path`` form, or a name of another package, is left as it is."""
    first = next((i for i, arg in enumerate(argv) if _STRATEGY_OPTION.match(arg)), None)
    if first is None:
        return argv
    strategy, given_at = _strategy_before(argv[:first])
    if not isinstance(strategy, str) or strategy not in _OPTIONS_OF:
        return argv
    as_class = ["--trainer.strategy=FrozenAwareDeepSpeedStrategy"]
    as_class += [f"--trainer.strategy.{key}={json.dumps(value)}" for key, value in _OPTIONS_OF[strategy].items()]
    before = [arg for i, arg in enumerate(argv[:first]) if i not in given_at]
    return [*before, *as_class, *argv[first:]]


# `--trainer.strategy.frozen_dtype=nf4`, not `--trainer.strategy.init_args.x` (the class form's) or `.help`
_STRATEGY_OPTION = re.compile(r"--trainer\.strategy\.(?!init_args\b|help\b|class_path\b)\w+")


def _strategy_before(argv: list[str]) -> tuple[Any, set[int]]:
    """The strategy that ``argv``'s ``--config`` files and ``--trainer.strategy`` give, in order (a name, or a
    ``class_path`` dict), ``frozen_deepspeed`` where none does; and the positions of the arguments that give it on the
    command line."""
    strategy: Any = "frozen_deepspeed"
    given_at: set[int] = set()
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        if flag in ("--config", "-c") and Path(value).is_file():
            trainer = (yaml.safe_load(Path(value).read_text()) or {}).get("trainer")
            if isinstance(trainer, dict) and "strategy" in trainer:
                strategy, given_at = trainer["strategy"], set()
        elif flag == "--trainer.strategy":
            strategy, given_at = value, {i} if "=" in arg else {i, i + 1}
    return strategy, given_at


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``lightning-frozen`` console script; ``args`` default to ``sys.argv[1:]``. A step of
    :data:`STEPS` runs by itself, anything else goes to Lightning's CLI (an unknown subcommand exits with status 2);
    the current directory goes first on ``sys.path``, as with ``python -m``, for a ``class_path`` of the project."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] and argv[0] in STEPS:
        run_step(argv[0], argv[1:])
        return
    if argv[:1] and not argv[0].startswith("-") and argv[0] not in subcommands():
        choices = ", ".join(repr(name) for name in subcommands())
        print(
            f"{PROG}: error: invalid choice: {argv[0]!r} (choose from {choices}); see `{PROG} --help`", file=sys.stderr
        )
        sys.exit(2)
    lightning_cli(strategy_named_with_options(argv), from_command_line=args is None)
