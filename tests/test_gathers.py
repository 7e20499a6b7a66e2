"""One owner of a ZeRO-3 param's gather methods over its life (zero/gathers.py): a replacement over another keeps
DeepSpeed's own, which come back whole at the end."""

from __future__ import annotations

import torch
from torch import nn

from lightning_frozen.zero import gathers


def _methods(tag: str) -> dict[str, object]:
    return {name: lambda *args, _name=name, **kwargs: (tag, _name) for name in gathers.METHODS}


def test_a_param_goes_from_exact_to_quantized_and_back_to_deepspeeds_own_methods() -> None:
    param = nn.Parameter(torch.zeros(2), requires_grad=False)
    deepspeeds = _methods("deepspeed")
    for name, method in deepspeeds.items():  # as DeepSpeed's Init attaches them to each param it converts
        setattr(param, name, method)
    assert gathers.kind_of(param) == gathers.DEEPSPEED
    assert gathers.deepspeed_method(param, "partition") is deepspeeds["partition"]

    gathers.use(param, gathers.EXACT_FROM_FILE, _methods("exact"))
    assert gathers.kind_of(param) == gathers.EXACT_FROM_FILE and param.all_gather() == ("exact", "all_gather")
    gathers.use(param, gathers.QUANTIZED, _methods("quantized"))
    assert gathers.kind_of(param) == gathers.QUANTIZED and param.partition() == ("quantized", "partition")
    # the originals are DeepSpeed's, not the replacement the quantized gather took over from
    assert gathers.deepspeed_method(param, "partition") is deepspeeds["partition"]

    gathers.use_deepspeed(param)
    assert gathers.kind_of(param) == gathers.DEEPSPEED
    assert all(getattr(param, name) is method for name, method in deepspeeds.items())
    gathers.use_deepspeed(param)  # nothing to give back a second time
    assert all(getattr(param, name) is method for name, method in deepspeeds.items())
