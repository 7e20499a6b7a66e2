"""DeepSpeed's accelerator made to match Lightning's for a run, the line said before it compiles its CPU op, and the
deprecation warnings of dependencies a run ignores."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from torch.utils import cpp_extension

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


def shared_memory_op_build_note() -> Optional[str]:
    """The line to say before DeepSpeed's process group starts on the CPU, where it will compile its shared-memory
    collectives (``deepspeed_shm_comm``, 20 to 60 s on a small machine, with nothing on the console); None where it
    loads a build it has (installed with DeepSpeed, or built by this torch in torch's extensions folder) or has none.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or installed_ops.get(builder.name, False) or not builder.is_compatible(verbose=False):
        return None
    folder = torch_extensions_folder() / builder.name
    ninja = folder / "build.ninja"
    # torch rebuilds an op another torch built (one default folder serves every venv of a Python)
    built_here = ninja.is_file() and cpp_extension.include_paths()[0] in ninja.read_text(errors="replace")
    if built_here and (folder / f"{builder.name}.so").is_file():
        return None
    return (
        f"lightning-frozen: DeepSpeed is compiling its shared-memory collectives for the CPU into {folder}, once: 30 s"
        " or more with no output (docs/faq.md)."
    )


def torch_extensions_folder() -> Path:
    """Where torch's JIT builds an op (``torch.utils.cpp_extension.load``): ``$TORCH_EXTENSIONS_DIR``, else a folder
    per Python and torch build under torch's default build root."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    hip, cuda = torch.version.hip, torch.version.cuda
    build = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(cpp_extension.get_default_build_root()) / f"{python}_{build}"


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
