"""The strategy's registered names, and checks of its arguments and DeepSpeed config before anything is built.

The CLI checks types from the signature; Python callers get the same refusals here, each naming the argument.
"""

from __future__ import annotations

import inspect
import os
import re
from datetime import timedelta
from typing import Any, Optional

from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_frozen.base.fingerprint import FINGERPRINT_MODES
from lightning_frozen.errors import InvalidArgumentTypeError, InvalidArgumentValueError, UnsupportedConfigurationError
from lightning_frozen.format.codec import check_frozen_dtype
from lightning_frozen.spec import StrategySpec
from lightning_frozen.zero.config import zero_settings

# the names `import lightning_frozen` registers: (name, description, strategy arguments)
REGISTERED_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("frozen_deepspeed", "ZeRO-3, frozen params sharded and offloaded to CPU memory", {}),
    (
        "frozen_deepspeed_offload",
        "ZeRO-3, frozen shards in CPU memory, optimizer stepped on the CPU (ZeRO-Offload)",
        {"offload_optimizer": True},
    ),
    (
        "frozen_deepspeed_no_offload",
        "ZeRO-3, frozen params sharded and kept on the accelerator",
        {"offload_frozen": False},
    ),
)


# the parameters of Lightning's `DeepSpeedStrategy.__init__`, in its order: the strategy's first ones, handed on to it
STOCK_ARGUMENTS: tuple[str, ...] = tuple(inspect.signature(DeepSpeedStrategy.__init__).parameters)[1:]


def register_names(strategy_registry: Any, strategy_class: type) -> None:
    """Register every name of :data:`REGISTERED_NAMES` for ``strategy_class`` in Lightning's ``StrategyRegistry``."""
    for name, description, options in REGISTERED_NAMES:
        strategy_registry.register(name, strategy_class, description=description, **options)


def check_strategy_arguments(
    flags: dict[str, Any],
    frozen_base: Any,
    timeout: Any,
    config: Any,
    fingerprint: Any,
    zero_optimization: bool,
    stage: Any,
    frozen_dtype: Any = None,
) -> None:
    """Refuse strategy arguments of the wrong type or value; ``flags`` are the arguments that must be booleans.

    Raises:
        InvalidArgumentTypeError: an argument of the wrong type, named with what it must be.
        InvalidArgumentValueError: an unknown ``fingerprint`` mode, or a ZeRO stage other than 3.
        FrozenDtypeError: a ``frozen_dtype`` other than None or one of ``quant_codec.FROZEN_DTYPES``.
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidArgumentTypeError(
                f"FrozenAwareDeepSpeedStrategy: `{name}` must be True or False, got {value!r}."
            )
    if frozen_base is not None and not isinstance(frozen_base, (str, os.PathLike)):
        raise InvalidArgumentTypeError(
            f"FrozenAwareDeepSpeedStrategy: `frozen_base` must be the base's path or hub id, got {frozen_base!r}."
        )
    if timeout is not None and not isinstance(timeout, timedelta):
        raise InvalidArgumentTypeError(
            f"FrozenAwareDeepSpeedStrategy: `timeout` must be a `datetime.timedelta`, e.g. `timedelta(minutes=10)`,"
            f" got {timeout!r}."
        )
    if config is not None and not isinstance(config, (str, os.PathLike, dict)):
        raise InvalidArgumentTypeError(
            f"FrozenAwareDeepSpeedStrategy: `config` must be a DeepSpeed config dict or the path of its JSON file,"
            f" got {config!r}."
        )
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise InvalidArgumentTypeError(
            f"FrozenAwareDeepSpeedStrategy: `stage` must be the int 3 (ZeRO stage 3 shards frozen params), got"
            f" {stage!r}."
        )
    if fingerprint not in FINGERPRINT_MODES:
        raise InvalidArgumentValueError(f"`fingerprint={fingerprint!r}` is not one of {FINGERPRINT_MODES}.")
    if zero_optimization and stage != 3:
        raise InvalidArgumentValueError(
            f"FrozenAwareDeepSpeedStrategy shards frozen params with ZeRO stage 3; got `stage={stage!r}`. Use"
            " Lightning's `DeepSpeedStrategy` for stages 1 and 2."
        )
    check_frozen_dtype(frozen_dtype)


# the units `generation_memory` reads: decimal (GB) and binary (GiB) multiples of a byte, case-insensitive
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update(kib=2**10, mib=2**20, gib=2**30, tib=2**40)
AUTO = "auto"
UNEVEN_BATCHES = ("join", "raise")  # what ranks that ran out of data do (docs/loops.md)


def memory_budget(value: Any, name: str = "generation_memory") -> Optional[int]:
    """The bytes a memory budget given as ``value`` allows: an int of bytes, or a string such as ``"20GB"``,
    ``"1.5 GiB"`` or ``"512MiB"``; None for ``"auto"`` (or None), which the caller sizes from the free memory.

    Raises:
        InvalidArgumentTypeError: neither an int nor a string.
        InvalidArgumentValueError: a string that is no size, or a budget below one byte.
    """
    if value is None or value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgumentTypeError(
            f"FrozenAwareDeepSpeedStrategy: `{name}` must be a number of bytes, a size such as '20GB' or '512MiB',"
            f" or 'auto', got {value!r}."
        )
    if isinstance(value, str):
        found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", value)
        unit = _SIZE_UNITS.get(found.group(2).lower()) if found else None
        if found is None or unit is None:
            raise InvalidArgumentValueError(
                f"FrozenAwareDeepSpeedStrategy: `{name}={value!r}` is not a size: write a number with B, KB, MB, GB,"
                " TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '20GB', or 'auto'."
            )
        value = int(float(found.group(1)) * unit)
    if value < 1:
        raise InvalidArgumentValueError(
            f"FrozenAwareDeepSpeedStrategy: `{name}` must allow at least 1 byte, got {value!r} (1 byte gathers"
            " layer by layer always)."
        )
    return value


def check_config_for_accelerator(config: Optional[dict], accelerator: Optional[Accelerator]) -> None:
    """Refuse DeepSpeed config options that cannot run on ``accelerator``.

    Raises:
        UnsupportedConfigurationError: ``zero_quantized_nontrainable_weights`` off CUDA.
    """
    zero_config = (config or {}).get("zero_optimization") or {}
    if zero_config.get("zero_quantized_nontrainable_weights") and not isinstance(accelerator, CUDAAccelerator):
        raise UnsupportedConfigurationError(
            "`zero_quantized_nontrainable_weights` stores frozen weights in int8 with DeepSpeed's CUDA kernels,"
            f" which do not run on `{type(accelerator).__name__}`. Remove it from the DeepSpeed config and"
            " pass `frozen_dtype='int8'` (or `'nf4'`) to the strategy, which runs on the CPU too, or train with"
            " `accelerator='gpu'`."
        )


def config_source(config: Any, environment_variable: str) -> Optional[str]:
    """Where the DeepSpeed config comes from, for messages: ``config=``, or the file the environment variable names
    (Lightning reads it when ``config`` is None); None when the strategy's arguments build it."""
    if config is not None:
        return "the DeepSpeed config (`config=`)"
    if environment_variable in os.environ:
        return f"the DeepSpeed config file {os.environ[environment_variable]} (from `{environment_variable}`)"
    return None


def resolve_spec(config: dict, source: Optional[str], pin_memory: bool, **arguments: Any) -> StrategySpec:
    """The strategy's :class:`StrategySpec`: ZeRO's settings read from its resolved DeepSpeed ``config``
    (:func:`zero_settings`), the rest from its ``arguments``; ``pin_memory`` also pins the offloaded frozen shards
    where no user config (``source``, :func:`config_source`) was given.

    Raises:
        InvalidArgumentValueError: another stage, or ZeRO off; the message names where it was set and the fix.
    """
    settings = zero_settings(config, pin_memory=pin_memory and source is None)
    if settings.stage != 3:
        where = source or "the strategy's arguments"
        found = f"ZeRO stage {settings.stage}" if settings.stage else "ZeRO switched off (`zero_optimization`)"
        raise InvalidArgumentValueError(
            f"FrozenAwareDeepSpeedStrategy shards frozen params with ZeRO stage 3, but {where} sets {found}. Set"
            ' `"zero_optimization": {"stage": 3, ...}` in the config (or leave `stage=3`, `zero_optimization=True`),'
            " or use Lightning's `DeepSpeedStrategy` for stages 0 to 2."
        )
    arguments["generation_memory"] = memory_budget(arguments.get("generation_memory"))
    if arguments.get("uneven_batches", UNEVEN_BATCHES[0]) not in UNEVEN_BATCHES:
        raise InvalidArgumentValueError(
            f"FrozenAwareDeepSpeedStrategy: `uneven_batches={arguments['uneven_batches']!r}` is not one of"
            f" {UNEVEN_BATCHES}: 'join' lets ranks that ran out of data serve the others until all have, 'raise'"
            " refuses uneven data with `UnevenBatchesError` (docs/loops.md)."
        )
    return StrategySpec(
        stage=settings.stage,
        offload_optimizer=settings.offload_optimizer,
        offload_param=settings.offload_param,
        pin_memory=settings.pin_memory,
        fit_reduce_bucket=settings.fit_reduce_bucket,
        **arguments,
    )
