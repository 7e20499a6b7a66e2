"""Which gather methods a ZeRO-3 param has, over its whole life: the one owner of its ``all_gather``,
``all_gather_coalesced`` and ``partition``, and the one table of DeepSpeed's own.

DeepSpeed 0.19 attaches these three methods to each param it converts (``Init._convert_to_deepspeed_param``); a
replacement keeps their contract (other params of the same call go on to DeepSpeed's methods, the coalesced gather
returns a handle with ``wait``). A param's life, and who asks for each change:

- built under ``zero.Init``: DeepSpeed's own (:data:`DEEPSPEED`);
- stored as codes as the sliced loader read it: exact values read from its file (:data:`EXACT_FROM_FILE`,
  ``zero/exact_gather.py``, asked by ``base/loaded.py``) until setup;
- at setup, frozen: its codes gathered and decoded (:data:`QUANTIZED`, ``zero/compute/quantized.py``); trainable:
  its exact values back in its shard and DeepSpeed's own again (:func:`use_deepspeed`, asked by ``base/loaded.py``);
- a run's teardown keeps them (the codes outlive the run, the next run gathers them), and ``unshard``
  (``zero/whole.py``) puts a plain param in its place: the table holds params weakly and forgets it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

METHODS = ("all_gather", "all_gather_coalesced", "partition")
# which methods a param has
DEEPSPEED = "DeepSpeed's own"
EXACT_FROM_FILE = "exact from file"
QUANTIZED = "quantized"

# DeepSpeed's own methods of each param whose methods were replaced, and which replacement it has now; kept here,
# not on the user's params
_deepspeed: WeakIdKeyDictionary = WeakIdKeyDictionary()
_kind: WeakIdKeyDictionary = WeakIdKeyDictionary()


def use(param: nn.Parameter, kind: str, methods: Mapping[str, Callable[..., Any]]) -> None:
    """Give ``param`` the gather methods of ``kind`` (one callable per name in :data:`METHODS`), in place of whichever
    it has now; DeepSpeed's own are kept the first time."""
    if param not in _deepspeed:
        _deepspeed[param] = {name: getattr(param, name) for name in METHODS}
    for name in METHODS:
        setattr(param, name, methods[name])
    _kind[param] = kind


def use_deepspeed(param: nn.Parameter) -> None:
    """Give ``param`` DeepSpeed's own gather methods back (nothing if it has them)."""
    for name, method in _deepspeed.pop(param, {}).items():
        setattr(param, name, method)
    _kind.pop(param, None)


def deepspeed_method(param: nn.Parameter, name: str) -> Callable[..., Any]:
    """DeepSpeed's own ``name`` method of ``param``, whichever it has now (a replacement partitions through it)."""
    kept = _deepspeed.get(param)
    return kept[name] if kept is not None else getattr(param, name)


def kind_of(param: nn.Parameter) -> str:
    """Which gather methods ``param`` has: :data:`DEEPSPEED`, :data:`EXACT_FROM_FILE` or :data:`QUANTIZED`."""
    return _kind.get(param, DEEPSPEED)
