"""The frozen storage, as the core sees it: which ``frozen_dtype`` a frozen ZeRO-3 shard's codes are in, codes put in
place of a shard's values and exact values put back, and whether a ``frozen_dtype`` fits the config and the device.

The codes are ``format/codec.py``'s (each rank's shard block-wise quantized, stored as one ``uint8`` tensor: the
codes, then the scales' bytes), encoded with the kernels a caller hands in (``zero/frozen_compute.py``'s), else tensor
ops. How a param holding codes is gathered and computed is behind that door; which gather methods it has,
``zero/gathers.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_frozen.errors import FrozenDtypeError
from lightning_frozen.format.codec import Kernels, block_format, decode, encode, split
from lightning_frozen.zero.params import compute_dtype, shard_numel

# the format each quantized shard is stored in, kept here rather than on the user's params; it outlives a run as long
# as the shard holds codes
_stored_as: WeakIdKeyDictionary = WeakIdKeyDictionary()
# who keeps another copy of a shard's codes (the CPU's node-shared file), told when they are replaced
_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()

# Told the values a frozen shard held just before they are encoded: the param, this rank's elements, the flat index of
# the first, and the whole tensor when it is at hand (written under `GatheredParameters`). Whoever needs the source
# values keeps what it needs of them (the strategy's record of the base, `base/loaded.py`); quantizing keeps nothing.
SourceValues = Callable[[nn.Parameter, torch.Tensor, int, Optional[torch.Tensor]], None]


def frozen_dtype_of(param: nn.Parameter) -> Optional[str]:
    """The ``frozen_dtype`` (``"int8"``, ``"nf4"``, ...) ``param``'s ZeRO-3 shard is stored in, else None."""
    return _stored_as.get(param)


def check_config(frozen_dtype: str, config: dict, device: torch.device) -> None:
    """Check that ``frozen_dtype`` fits the DeepSpeed ``config`` and runs on ``device`` in the compute dtype.

    Raises:
        FrozenDtypeError: ZeRO stage 3 is off, DeepSpeed's own ``zero_quantized_nontrainable_weights`` is on too,
            params are offloaded to NVMe, or the accelerator cannot run the dequantization.
    """
    zero_config = config.get("zero_optimization") or {}
    if zero_config.get("stage") != 3:
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` stores ZeRO-3 shards, but ZeRO stage {zero_config.get('stage')} is"
            " configured. Use `stage=3` (the default of `frozen_deepspeed`)."
        )
    if zero_config.get("zero_quantized_nontrainable_weights") or zero_config.get("zero_quantized_weights"):
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` and DeepSpeed's `zero_quantized_(nontrainable_)weights` both quantize"
            " the frozen shards. Remove the DeepSpeed option from the config."
        )
    if ((zero_config.get("offload_param") or {}).get("device")) == "nvme":
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` keeps shards in host or device memory; DeepSpeed's NVMe parameter"
            " offload swaps them as compute-dtype tensors. Remove `offload_param: {device: nvme}` or the frozen_dtype."
        )
    check_runs_on(frozen_dtype, device, compute_dtype(config) or torch.float32)


def check_runs_on(frozen_dtype: str, device: torch.device, dtype: torch.dtype) -> None:
    """Quantize and dequantize one block on ``device`` in ``dtype``, as training will (the compiled kernels decline
    device tensors).

    Raises:
        FrozenDtypeError: the accelerator cannot run it; the message names the device and the fix.
    """
    fmt = block_format(frozen_dtype)
    try:
        sample = torch.linspace(-1, 1, fmt.block_size, device=device)
        decode(encode(sample, frozen_dtype), fmt.block_size, frozen_dtype, dtype)
    except (RuntimeError, AssertionError, TypeError) as error:
        raise FrozenDtypeError(
            f"`frozen_dtype={frozen_dtype!r}` cannot dequantize to {dtype} on `{device}`"
            f" ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Train on an accelerator"
            " that runs it, or pass `frozen_dtype=None`."
        ) from error


def store_codes(
    param: nn.Parameter, values: torch.Tensor, frozen_dtype: str, kernels: Optional[Kernels] = None
) -> None:
    """Put the codes of ``values`` (this rank's elements of ``param``, in its dtype; encoded with ``kernels`` where
    they take them) in place of its ZeRO-3 shard, padded as the shard is, so that blocks align with the shard: encoding
    a slice as it is read gives the codes of encoding the shard it was read into."""
    fmt = block_format(frozen_dtype)
    store_encoded(param, encode(values, fmt.name, numel=shard_numel(param), kernels=kernels), fmt.name)


def keeps_a_copy(param: nn.Parameter, replaced: Callable[[nn.Parameter], None]) -> None:
    """Call ``replaced(param)`` once, before ``param``'s codes are replaced or its values restored: whoever keeps
    another copy of them (the CPU's node-shared file) lets it go then."""
    _copies[param] = replaced


def _replace(param: nn.Parameter) -> None:
    replaced = _copies.pop(param, None)
    if replaced is not None:
        replaced(param)


def restore_values(param: nn.Parameter, values: torch.Tensor) -> None:
    """Put this rank's exact ``values`` of ``param`` (in its dtype) back in place of its codes, as an ordinary shard."""
    _replace(param)
    shard = param.ds_tensor
    full = torch.zeros(shard_numel(param), dtype=param.dtype, device=shard.device)
    full[: values.numel()] = values.to(full.device)
    shard.data = full
    del shard.ds_quant_scale
    del _stored_as[param]


def store_encoded(param: nn.Parameter, stored: torch.Tensor, frozen_dtype: str, pin: bool = True) -> None:
    """Put the encoded bytes ``stored`` in place of ``param``'s shard (in page-locked memory where the shard was and
    ``pin`` says so); ``ds_quant_scale`` routes the param to the quantized gather."""
    from deepspeed.accelerator import get_accelerator

    _replace(param)  # another copy of the codes holds the old ones
    shard = param.ds_tensor
    if pin and shard.device.type == "cpu" and shard.is_pinned():
        stored = get_accelerator().pin_memory(stored)
    shard.data = stored
    shard.ds_quant_scale = split(stored, frozen_dtype)[1]
    _stored_as[param] = frozen_dtype
