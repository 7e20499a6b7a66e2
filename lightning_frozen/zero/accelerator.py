"""DeepSpeed's accelerator made to match Lightning's for a run, and the deprecation warnings of dependencies a run
ignores."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator

from lightning_frozen.errors import UnsupportedConfigurationError

_DEEPSPEED_ACCELERATOR_OF = {CPUAccelerator: "cpu", CUDAAccelerator: "cuda"}


@contextmanager
def deepspeed_accelerator_matching(accelerator: Optional[Accelerator]) -> Iterator[None]:
    """While active, DeepSpeed's accelerator matches Lightning's ``accelerator``; on exit DeepSpeed's own one is back
    (the object it had before, where it was changed).

    Raises:
        UnsupportedConfigurationError: ``accelerator`` is neither CUDA nor the CPU, or ``DS_ACCELERATOR`` pins another.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator

    wanted = next((name for cls, name in _DEEPSPEED_ACCELERATOR_OF.items() if isinstance(accelerator, cls)), None)
    if wanted is None:
        raise UnsupportedConfigurationError(
            f"lightning-frozen runs DeepSpeed on `CUDAAccelerator` or `CPUAccelerator`, not"
            f" `{type(accelerator).__name__}`. Pass `accelerator='gpu'` or `accelerator='cpu'` to the Trainer."
        )
    before = get_accelerator()
    if before.device_name() == wanted:
        yield
        return
    pinned = os.environ.get("DS_ACCELERATOR")
    if pinned:
        raise UnsupportedConfigurationError(
            f"Lightning trains on `{type(accelerator).__name__}` but `DS_ACCELERATOR={pinned}` makes DeepSpeed use"
            f" its `{before.device_name()}` accelerator. Unset DS_ACCELERATOR or set it to `{wanted}`, or change the"
            " Trainer's `accelerator`."
        )
    if wanted == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        set_accelerator(CUDA_Accelerator())
    try:
        yield
    finally:
        set_accelerator(before)


# torch 2.13's deprecation messages for what DeepSpeed 0.19 and Lightning 2.6 call every step: not the user's to fix
DEPENDENCY_DEPRECATIONS = (
    r"`(torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)|isinstance\(treespec, LeafSpec\))`"
    r" is deprecated[.,] (Please )?use `"
)


def ignore_dependency_deprecations() -> Callable[[], None]:
    """Ignore :data:`DEPENDENCY_DEPRECATIONS` only, after the user's own filters; ``append=True`` adds no second copy.

    Returns what takes the filter off again (nothing, where an equal filter was there before), for the end of a run.
    """
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", DEPENDENCY_DEPRECATIONS, FutureWarning, append=True)
    added = [entry for entry in warnings.filters if entry not in before]
    return functools.partial(_remove_filters, added)


def _remove_filters(entries: list[tuple]) -> None:
    # an "ignore" entry caches nothing in the modules' warning registries, so taking it off needs no cache reset
    for entry in entries:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
