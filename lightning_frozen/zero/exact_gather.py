"""A ZeRO-3 param whose gathers are answered without a collective for a while (``zero/gathers.py``'s
:data:`~lightning_frozen.zero.gathers.EXACT_FROM_FILE`): the sliced loader's params stored as codes read their exact
values from the file until setup (``base/loaded.py`` says why), and a write under ``GatheredParameters`` is handed back
to the caller to encode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.zero import gathers
from lightning_frozen.zero.init import outside_zero_init
from lightning_frozen.zero.params import is_released, mark_gathered


def override_gathers(
    param: nn.Parameter,
    exact: Callable[[nn.Parameter], bool],
    read: Callable[[nn.Parameter], torch.Tensor],
    written: Callable[[nn.Parameter], None],
) -> None:
    """From now on, gathering ``param`` (or any param of the same call for which ``exact(p)`` holds) puts ``read(p)``,
    the whole tensor, in place of its shard, with no collective. Partitioning such a param after a write (DeepSpeed's
    ``has_been_updated``) calls ``written(p)`` with the written values in ``p.data``, outside ``zero.Init`` (new
    tensors are ordinary ones); ``written`` must store them and give ``p`` other gathers (``zero/gathers.py``), which
    then partition it. Without a write, DeepSpeed's partition frees the values."""

    def all_gather(param_list: Optional[list] = None, async_op: bool = False, hierarchy: int = 0) -> Any:
        params = [param] if param_list is None else list(param_list)
        others = [p for p in params if not exact(p)]
        for p in params:
            if exact(p) and is_released(p):
                mark_gathered(p, read(p))
        if others:
            return others[0].all_gather(param_list=others, async_op=async_op, hierarchy=hierarchy)
        return [] if async_op else None

    def all_gather_coalesced(params: Any, safe_mode: bool = False, quantize: bool = False) -> Any:
        params = list(params)
        others = [p for p in params if not exact(p)]
        all_gather([p for p in params if exact(p)])
        if others:
            return others[0].all_gather_coalesced(others, safe_mode=safe_mode, quantize=quantize)
        return _Done()

    def partition(
        param_list: Optional[list] = None, hierarchy: int = 0, has_been_updated: bool = False, free_data: bool = True
    ) -> None:
        params = [param] if param_list is None else list(param_list)
        others = [p for p in params if not exact(p)]
        for p in params:
            if not exact(p):
                continue
            if has_been_updated:
                with outside_zero_init():  # a write inside `configure_model` runs under zero.Init's tensor patches
                    written(p)
                p.partition(param_list=[p], hierarchy=hierarchy, free_data=free_data)
            else:
                gathers.deepspeed_method(p, "partition")(param_list=[p], hierarchy=hierarchy, free_data=free_data)
        if others:
            others[0].partition(
                param_list=others, hierarchy=hierarchy, has_been_updated=has_been_updated, free_data=free_data
            )

    methods = {"all_gather": all_gather, "all_gather_coalesced": all_gather_coalesced, "partition": partition}
    gathers.use(param, gathers.EXACT_FROM_FILE, methods)


class _Done:
    """The handle of a gather that already happened (the values were read)."""

    def wait(self, handle_dependency: bool = True) -> None:
        return None
