"""What the package uses of transformers' internals, all in one place.

- ``from_pretrained`` under ZeRO-3 (:func:`zero3_loading`): an ``HfDeepSpeedConfig`` kept alive switches
  transformers' ZeRO-3 path on, and its two private loading steps ``modeling_utils.load_state_dict`` and
  ``modeling_utils._load_state_dict_into_zero3_model`` are replaced for the duration, only where the names of
  ``capabilities.SLICED_LOADING`` are the ones written for; else transformers' own ZeRO-3 loader runs. With them, the
  model is built in the dtype DeepSpeed stores it in (``PreTrainedModel.get_init_context``'s ``dtype``), where
  transformers would build it in the checkpoint's.
- The key renamings and conversions its loader applies: ``hf/conversions.py``.
- Its safetensors reader, ``modeling_utils.safe_open``, wrapped while it loads a base (:func:`base_files_named`), so
  that a truncated or corrupt shard raises :class:`~lightning_frozen.errors.FrozenBaseFileError` naming the file.
- A ``quantization_config`` of bitsandbytes taken off ``from_pretrained`` (:func:`bitsandbytes_taken_off`): its
  ``modeling_utils.get_hf_quantizer`` is wrapped so the model keeps its ``nn.Linear`` layers, and the settings go to
  a handler as plain values (:class:`BitsAndBytesSettings`); models bitsandbytes quantized: :func:`bitsandbytes_layers`;
  bitsandbytes' own markers set on a model the strategy stores quantized: :func:`mark_loaded_in_kbit`.
- Its private markers: ``modeling_utils._is_ds_init_called`` (:func:`building_model`) and a tensor's
  ``_is_hf_initialized`` (:func:`mark_initialized`).

Nothing here imports transformers before a function needs it, and only where it is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.capabilities import SLICED_LOADING, ZERO3_SWITCH, available
from lightning_frozen.errors import FrozenBaseFileError


@dataclass(frozen=True)
class BitsAndBytesSettings:
    """What a ``BitsAndBytesConfig`` asks for, as plain values. ``pre_quantized``: the folder's own ``config.json``
    holds a ``quantization_config`` (its weights are stored quantized already), of ``quant_method``."""

    load_in_4bit: bool = False
    load_in_8bit: bool = False
    quant_type: str = "fp4"
    double_quant: bool = False
    compute_dtype: Optional[torch.dtype] = None
    skip_modules: tuple[str, ...] = ()
    has_fp16_weight: bool = False
    pre_quantized: bool = False
    quant_method: str = "bitsandbytes"
    source: str = ""


@contextmanager
def zero3_loading(
    config: dict,
    load_state_dict: Callable[..., dict],
    load_into_zero3: Callable[..., tuple[list[str], set[str]]],
    build_dtype: Optional[torch.dtype] = None,
) -> Iterator[bool]:
    """While active, ``from_pretrained`` builds ZeRO-3 params for the DeepSpeed ``config`` (:func:`zero3_known`),
    transformers' ``load_state_dict`` and ``_load_state_dict_into_zero3_model`` are replaced by ``load_state_dict`` and
    ``load_into_zero3`` (each given the original first), and the model is built in ``build_dtype`` (:func:`built_in`).
    Yields whether they were replaced: only where ``capabilities.SLICED_LOADING`` is on (never without transformers).
    """
    if importlib.util.find_spec("transformers") is None:
        yield False
        return
    from transformers import modeling_utils

    patched = available(SLICED_LOADING)
    if patched:
        originals = (modeling_utils.load_state_dict, modeling_utils._load_state_dict_into_zero3_model)
        modeling_utils.load_state_dict = functools.partial(load_state_dict, originals[0])
        modeling_utils._load_state_dict_into_zero3_model = functools.partial(load_into_zero3, originals[1])
    try:
        with zero3_known(config), base_files_named(), built_in(build_dtype if patched else None):
            yield patched
    finally:
        if patched:
            modeling_utils.load_state_dict, modeling_utils._load_state_dict_into_zero3_model = originals


@contextmanager
def zero3_known(config: dict) -> Iterator[None]:
    """While active, an ``HfDeepSpeedConfig`` of ``config`` is alive, so ``is_deepspeed_zero3_enabled()`` is true and
    every ``from_pretrained`` builds ZeRO-3 params; the caller's one is restored on exit. Without transformers:
    nothing. Entered around ``configure_model`` and a step of a model that drops layers, nowhere else."""
    if importlib.util.find_spec("transformers") is None:
        yield
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    restores = available(ZERO3_SWITCH)  # else transformers' public unset, after
    previous = hf_deepspeed._hf_deepspeed_config_weak_ref if restores else None
    hf_config = hf_deepspeed.HfDeepSpeedConfig(config)
    try:
        yield
    finally:
        if restores:
            hf_deepspeed._hf_deepspeed_config_weak_ref = previous
        else:
            hf_deepspeed.unset_hf_deepspeed_config()
        del hf_config


def drops_layers(module: nn.Module) -> bool:
    """Whether a transformers model in ``module`` skips layers at random in training (``config.layerdrop > 0``:
    wav2vec2, HuBERT, WavLM, ...). Its forward asks transformers whether ZeRO-3 is on, to run every layer on every rank
    then: each layer's gather is a collective, and ranks that skipped different layers would wait on each other."""
    rates = (getattr(getattr(sub, "config", None), "layerdrop", 0) for sub in module.modules())
    return any(isinstance(rate, (int, float)) and rate > 0 for rate in rates)


@contextmanager
def built_in(dtype: Optional[torch.dtype]) -> Iterator[None]:
    """While active, ``from_pretrained`` builds its model with ``dtype`` (the one ``zero.Init`` casts to) as torch's
    default, not the checkpoint's, so no full tensor is cast before the loader fills the shards (docs/internals.md);
    None does nothing."""
    from transformers import modeling_utils

    owner = modeling_utils.PreTrainedModel
    original = owner.__dict__.get("get_init_context")
    if dtype is None or not isinstance(original, classmethod):
        yield
        return

    def get_init_context(cls: type, checkpoint_dtype: Any, is_quantized: bool, *args: Any, **kwargs: Any) -> Any:
        # a quantized model is built on the meta device by transformers' own loader: left as it is
        build = dtype if isinstance(checkpoint_dtype, torch.dtype) and not is_quantized else checkpoint_dtype
        return original.__func__(cls, build, is_quantized, *args, **kwargs)

    owner.get_init_context = classmethod(get_init_context)
    try:
        yield
    finally:
        owner.get_init_context = original


@contextmanager
def base_files_named() -> Iterator[None]:
    """While active, a safetensors file that transformers cannot open (truncated, corrupt) raises
    :class:`~lightning_frozen.errors.FrozenBaseFileError` naming it, instead of safetensors' error without the file's
    name. Does nothing where transformers is not imported yet (a module without it does not pay for its import) or
    reads no ``modeling_utils.safe_open``."""
    modeling_utils = None
    if "transformers" in sys.modules:
        from transformers import modeling_utils
    original = getattr(modeling_utils, "safe_open", None)
    if original is None:
        yield
        return
    from safetensors import SafetensorError

    def safe_open(filename: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(filename, *args, **kwargs)
        except SafetensorError as error:
            raise FrozenBaseFileError(str(filename), str(error)) from error

    modeling_utils.safe_open = safe_open
    try:
        yield
    finally:
        modeling_utils.safe_open = original


@contextmanager
def bitsandbytes_taken_off(on_bitsandbytes: Callable[[BitsAndBytesSettings], None]) -> Iterator[bool]:
    """While active, ``from_pretrained`` given a bitsandbytes ``quantization_config`` (or a folder whose config holds
    one, taken off the model's config: ``pre_quantized=True``) calls ``on_bitsandbytes`` with its settings, which may
    raise, and then loads as if none was given. Yields whether ``get_hf_quantizer`` was wrapped: only where
    ``capabilities.SLICED_LOADING`` is on.
    """
    if importlib.util.find_spec("transformers") is None:
        yield False
        return
    from transformers import modeling_utils

    original = getattr(modeling_utils, "get_hf_quantizer", None)
    if not available(SLICED_LOADING):
        yield False
        return

    @functools.wraps(original)  # type: ignore[arg-type]
    def get_hf_quantizer(config: Any, quantization_config: Any, *args: Any, **kwargs: Any) -> Any:
        stored = getattr(config, "quantization_config", None)
        if stored is not None:
            on_bitsandbytes(stored_settings(stored, getattr(config, "name_or_path", "") or "the folder"))
            for holder in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
                if getattr(holder, "quantization_config", None) is not None:  # the model's layers stay `nn.Linear`
                    delattr(holder, "quantization_config")
        settings = _bitsandbytes_settings(quantization_config)
        if settings is not None:
            on_bitsandbytes(settings)
            quantization_config = None
        return original(config, quantization_config, *args, **kwargs)  # type: ignore[misc]

    modeling_utils.get_hf_quantizer = get_hf_quantizer
    try:
        yield True
    finally:
        modeling_utils.get_hf_quantizer = original


def stored_settings(stored: Any, source: str) -> BitsAndBytesSettings:
    """The settings of a folder's own ``quantization_config`` (``stored``: a dict, as config.json holds it, or a
    config), read from ``source``: ``pre_quantized``, with its ``quant_method``."""
    method = stored.get("quant_method") if isinstance(stored, dict) else getattr(stored, "quant_method", "")
    method = str(getattr(method, "value", method))
    found = (_bitsandbytes_settings(stored) if method == "bitsandbytes" else None) or BitsAndBytesSettings()
    return dataclasses.replace(found, pre_quantized=True, quant_method=method, source=source)


def _bitsandbytes_settings(quantization_config: Any) -> Optional[BitsAndBytesSettings]:
    from transformers import BitsAndBytesConfig

    if isinstance(quantization_config, dict):
        bits = "load_in_4bit" in quantization_config or "load_in_8bit" in quantization_config
        if bits and quantization_config.get("quant_method", "bitsandbytes") == "bitsandbytes":
            quantization_config = BitsAndBytesConfig.from_dict(quantization_config)
    if not isinstance(quantization_config, BitsAndBytesConfig):
        return None
    compute_dtype = quantization_config.bnb_4bit_compute_dtype
    return BitsAndBytesSettings(
        load_in_4bit=bool(quantization_config.load_in_4bit),
        load_in_8bit=bool(quantization_config.load_in_8bit),
        quant_type=str(quantization_config.bnb_4bit_quant_type),
        double_quant=bool(quantization_config.bnb_4bit_use_double_quant),
        compute_dtype=compute_dtype if isinstance(compute_dtype, torch.dtype) else None,
        skip_modules=tuple(quantization_config.llm_int8_skip_modules or ()),
        has_fp16_weight=bool(quantization_config.llm_int8_has_fp16_weight),
    )


def bitsandbytes_layers(module: nn.Module) -> list[str]:
    """The names of ``module``'s params that bitsandbytes quantized (of its ``Params4bit`` / ``Int8Params`` classes;
    not the ``is_loaded_in_4bit`` marker, which :func:`mark_loaded_in_kbit` also sets)."""
    return [name for name, param in module.named_parameters() if type(param).__name__ in ("Params4bit", "Int8Params")]


def mark_loaded_in_kbit(model: nn.Module, bits: int) -> None:
    """Set the marker transformers' bitsandbytes quantizer sets (``is_loaded_in_4bit`` / ``is_loaded_in_8bit``) on a
    model whose frozen shards the strategy stores in ``bits``: PEFT's ``prepare_model_for_kbit_training`` reads it to
    enable gradient checkpointing and input gradients, as for a bitsandbytes model."""
    setattr(model, "is_loaded_in_4bit" if bits == 4 else "is_loaded_in_8bit", True)


def building_model() -> bool:
    """Whether ``from_pretrained`` is inside its model's ``__init__`` under its own ``zero.Init`` right now."""
    return bool(getattr(sys.modules.get("transformers.modeling_utils"), "_is_ds_init_called", False))


def mark_initialized(tensor: torch.Tensor) -> None:
    """Tell ``from_pretrained`` that ``tensor`` is loaded: it initialises only the tensors left unmarked."""
    tensor._is_hf_initialized = True


def loaded_from(module: nn.Module) -> Optional[str]:
    """The hub id or folder a Hugging Face model (or config) was loaded from, ``config.name_or_path``; None if
    ``module`` has no config or it names none."""
    reference = getattr(getattr(module, "config", None), "name_or_path", None)
    return reference if isinstance(reference, str) and reference else None
