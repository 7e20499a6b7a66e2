"""A QLoRA user's ``BitsAndBytesConfig`` under the strategy: the frozen base stored as the strategy's own shards.

A bitsandbytes ``quantization_config`` given to ``from_pretrained`` in ``configure_model`` is taken off the call (ZeRO-3
cannot shard ``Linear4bit``) and becomes the strategy's ``frozen_dtype`` (``load_in_4bit`` with nf4: ``"nf4"``,
``load_in_8bit``: ``"int8"``); what has no such storage is refused (:class:`BitsAndBytesConfigError`), as is a model
bitsandbytes already quantized. A folder bitsandbytes saved as 4-bit nf4 loads as ``"nf4"`` (``base/prequantized.py``);
other pre-quantized folders are refused. docs/frozen-storage.md tells the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_frozen.errors import BitsAndBytesConfigError, format_names
from lightning_frozen.hf import transformers_loading
from lightning_frozen.hf.transformers_loading import BitsAndBytesSettings

# bytes per weight: our NF4 (fp16 scale per 64), bitsandbytes' with double quantization (8-bit scales, fp32 per 256)
NF4_BYTES, DOUBLE_QUANT_BYTES = 0.531, 0.516


def frozen_dtype_for(settings: BitsAndBytesSettings, frozen_dtype: Optional[str]) -> Optional[str]:
    """The ``frozen_dtype`` that stores what ``settings`` asks for (None: it asks for no quantization), checked
    against the strategy's ``frozen_dtype`` (None: not set).

    Raises:
        BitsAndBytesConfigError: a pre-quantized folder, fp4, a trainable int8 base (``llm_int8_has_fp16_weight``),
            ``llm_int8_skip_modules``, or a ``frozen_dtype`` that disagrees; the message names the setting and the fix.
    """
    if settings.pre_quantized:
        return _pre_quantized(settings, frozen_dtype)
    if not (settings.load_in_4bit or settings.load_in_8bit):
        return None
    if settings.load_in_4bit and settings.quant_type != "nf4":
        raise BitsAndBytesConfigError(
            f"`bnb_4bit_quant_type={settings.quant_type!r}`: the strategy stores a 4-bit frozen base as NF4 only."
            " Pass `bnb_4bit_quant_type='nf4'` (QLoRA's), or leave out `quantization_config` and choose the"
            " strategy's `frozen_dtype` ('nf4', 'int8', 'bf16', 'fp16')."
        )
    if settings.load_in_8bit and settings.has_fp16_weight:
        raise BitsAndBytesConfigError(
            "`llm_int8_has_fp16_weight=True` trains the int8 base itself; under the strategy the base is frozen and"
            " stored as int8 codes. Remove `llm_int8_has_fp16_weight`, or leave out `quantization_config` to train"
            " base weights (set `requires_grad=True` on them) in the compute dtype."
        )
    if settings.skip_modules:
        raise BitsAndBytesConfigError(
            f"`llm_int8_skip_modules={list(settings.skip_modules)}`: the strategy stores every frozen param in one"
            " `frozen_dtype` and cannot leave some unquantized; params that train (PEFT's `modules_to_save`, a"
            " param with `requires_grad=True`) are kept exact anyway. Remove `llm_int8_skip_modules`, or leave out"
            " `quantization_config` and use `frozen_dtype='bf16'` (or None) for an unquantized base."
        )
    wanted = "nf4" if settings.load_in_4bit else "int8"
    if frozen_dtype is not None and frozen_dtype != wanted:
        raise BitsAndBytesConfigError(
            f"`from_pretrained`'s `quantization_config` ({describe(settings)}) asks for `frozen_dtype={wanted!r}`,"
            f" but the strategy has `frozen_dtype={frozen_dtype!r}`. Keep one of them: remove `quantization_config`"
            f" from `from_pretrained`, or `frozen_dtype` from the strategy."
        )
    return wanted


def _pre_quantized(settings: BitsAndBytesSettings, frozen_dtype: Optional[str]) -> str:
    """``"nf4"`` for a folder bitsandbytes saved as nf4 (``base/prequantized.py`` reads its codes); else refused."""
    stored = f"`{settings.source}`: its config.json says its weights are stored quantized"
    unquantized = (
        " Load the unquantized checkpoint it was made from, with the strategy's `frozen_dtype='nf4'` (or 'int8'), or a"
        " folder bitsandbytes saved as 4-bit nf4."
    )
    if settings.quant_method != "bitsandbytes":
        raise BitsAndBytesConfigError(
            f"{stored} by {settings.quant_method} (`quant_method={settings.quant_method!r}`), a format the strategy"
            " cannot read: it stores frozen shards from unquantized weights or from bitsandbytes' nf4." + unquantized
        )
    if settings.load_in_8bit or settings.quant_type != "nf4":
        kind = "8-bit (LLM.int8(), a scale per row)" if settings.load_in_8bit else f"4-bit {settings.quant_type}"
        raise BitsAndBytesConfigError(
            f"{stored} by bitsandbytes as {kind}; the strategy reads bitsandbytes' 4-bit nf4 folders only, whose"
            " codes are its own NF4's." + unquantized
        )
    if frozen_dtype not in (None, "nf4"):
        raise BitsAndBytesConfigError(
            f"{stored} by bitsandbytes as 4-bit nf4, which loads as `frozen_dtype='nf4'`, but the strategy has"
            f" `frozen_dtype={frozen_dtype!r}`. Remove `frozen_dtype` from the strategy (or pass 'nf4')."
        )
    return "nf4"


def describe(settings: BitsAndBytesSettings) -> str:
    """``load_in_4bit, nf4`` or ``load_in_8bit``: what a bitsandbytes config asks for, for a message."""
    return f"load_in_4bit, {settings.quant_type}" if settings.load_in_4bit else "load_in_8bit"


def notice(settings: BitsAndBytesSettings, frozen_dtype: str, compute_dtype: torch.dtype) -> str:
    """The one line that says what became of a bitsandbytes config under the strategy."""
    if settings.pre_quantized:
        return (
            f"lightning-frozen: `{settings.source}` holds bitsandbytes nf4 weights"
            f"{' (double quantization)' if settings.double_quant else ''}: they load as the strategy's"
            " `frozen_dtype='nf4'`, each rank reading the codes and scales of its own blocks; the codes are the"
            " folder's, the scales fp16 rounded up (each weight at most 2^-10 of itself off bitsandbytes' fp32"
            f" dequantization), and layers compute in {_name(compute_dtype)}."
        )
    line = (
        f"lightning-frozen: `quantization_config=BitsAndBytesConfig({describe(settings)})` is the strategy's"
        f" `frozen_dtype={frozen_dtype!r}`: bitsandbytes does not quantize, the frozen shards are stored as"
        f" {frozen_dtype} codes as they are read, and layers compute in {_name(compute_dtype)} (the Trainer's precision"
    )
    if settings.load_in_4bit and settings.compute_dtype not in (None, compute_dtype):
        line += f"; `bnb_4bit_compute_dtype={_name(settings.compute_dtype)}` is not used"
    line += ")"
    if settings.load_in_4bit and settings.double_quant:
        line += (
            f"; `bnb_4bit_use_double_quant` is not applied: fp16 scales, {NF4_BYTES} bytes per weight against"
            f" {DOUBLE_QUANT_BYTES}"
        )
    return line + "."


@contextmanager
def adopted_as_frozen_dtype(
    current: Callable[[], Optional[str]], adopt: Callable[[str], None], compute_dtype: torch.dtype
) -> Iterator[None]:
    """While active (``configure_model`` under the strategy), a bitsandbytes ``quantization_config`` given to
    ``from_pretrained`` is taken off the call and ``adopt``-ed as the ``frozen_dtype`` (checked against ``current()``),
    with a notice; what cannot map raises :class:`BitsAndBytesConfigError`."""

    def take(settings: BitsAndBytesSettings) -> None:
        frozen_dtype = frozen_dtype_for(settings, current())
        if frozen_dtype is not None:
            rank_zero_info(notice(settings, frozen_dtype, compute_dtype))
            adopt(frozen_dtype)

    with transformers_loading.bitsandbytes_taken_off(take):
        yield


@contextmanager
def loaded_unquantized() -> Iterator[None]:
    """While active (a module built for use, without the strategy), a bitsandbytes ``quantization_config`` is taken
    off ``from_pretrained``: the base loads unquantized, the values the checkpoint's fingerprint was taken of."""

    def take(settings: BitsAndBytesSettings) -> None:
        frozen_dtype = frozen_dtype_for(settings, None)
        if settings.pre_quantized:
            raise BitsAndBytesConfigError(
                f"`{settings.source}` holds bitsandbytes nf4 weights, which load as codes only under the strategy;"
                " here the base is built unquantized. Dequantize it once (with bitsandbytes installed:"
                " `AutoModelForCausalLM.from_pretrained(folder).dequantize().save_pretrained(unquantized)`) and pass"
                " that folder instead: its weights are the ones the checkpoint's fingerprint is of."
            )
        if frozen_dtype is not None:
            rank_zero_info(
                f"lightning-frozen: `quantization_config=BitsAndBytesConfig({describe(settings)})` is taken off"
                " `from_pretrained`: the base loads unquantized, the weights the checkpoint's fingerprint is of (it"
                f" trained over their {frozen_dtype} codes)."
            )

    with transformers_loading.bitsandbytes_taken_off(take):
        yield


def check_not_quantized(module: nn.Module) -> None:
    """Refuse a module that bitsandbytes quantized already (``from_pretrained`` with a ``quantization_config`` in
    ``__init__``): ZeRO-3 cannot shard bitsandbytes' packed params.

    Raises:
        BitsAndBytesConfigError: naming the quantized params and the fix (the load moved into ``configure_model``).
    """
    quantized = transformers_loading.bitsandbytes_layers(module)
    if quantized:
        raise BitsAndBytesConfigError(
            f"`{type(module).__name__}` holds params that bitsandbytes quantized ({format_names(quantized)}):"
            " `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` ran outside `configure_model`, and"
            " ZeRO-3 cannot shard bitsandbytes' packed params. Move the `from_pretrained` and `get_peft_model` calls"
            " from `__init__` into the LightningModule's `configure_model`: there the strategy stores the base as its"
            " own frozen shards (`load_in_4bit`/nf4 as `frozen_dtype='nf4'`, `load_in_8bit` as 'int8'), each rank"
            " reading only its slice."
        )


def _name(dtype: Optional[torch.dtype]) -> str:
    return str(dtype).removeprefix("torch.")
