"""Every private name of another package the package relies on, one table by package, checked once per process when
a strategy is built: a run that has started never meets a missing attribute, and a renamed hook of Lightning's never
leaves the strategy running as stock DeepSpeed.

A name the package needs that moved (gone, another signature, an attribute no longer set) raises
:class:`~lightning_frozen.errors.DependencyDriftError`; one the package runs correctly without (a ``fallback``) warns
once. A package that is not installed is skipped: its seam does nothing without it.
"""

from __future__ import annotations

import functools
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_frozen import lightning_seam
from lightning_frozen.errors import DependencyDriftError
from lightning_frozen.foreign_names import ForeignName, drift_message, fallback_warning, installed_version, problem_of
from lightning_frozen.hf import private_names as hf_names
from lightning_frozen.zero import private_names as zero_names

PRIVATE_NAMES: dict[str, tuple[ForeignName, ...]] = dict(
    lightning=lightning_seam.PRIVATE_NAMES,
    deepspeed=zero_names.DEEPSPEED,
    torch=zero_names.TORCH,
    transformers=hf_names.TRANSFORMERS,
    peft=hf_names.PEFT,
)


@functools.cache
def look_up_private_names() -> tuple[tuple[ForeignName, str], ...]:
    """Look up every name of :data:`PRIVATE_NAMES` in the installed packages, once per process: warn about each moved
    name the package runs without, and return those it needs that moved, with what is wrong."""
    rows = (row for package, rows in PRIVATE_NAMES.items() if installed_version(package) for row in rows)
    with warnings.catch_warnings():  # PEFT imports accelerate, whose import adds a filter: the process's stay as found
        moved = [(row, problem) for row in rows if (problem := problem_of(row)) is not None]
    for row, problem in moved:
        if row.fallback:
            rank_zero_warn(fallback_warning(row, problem))
    return tuple((row, problem) for row, problem in moved if not row.fallback)


def check_private_names() -> None:
    """Check the installed packages against :data:`PRIVATE_NAMES` (:func:`look_up_private_names`).

    Raises:
        DependencyDriftError: a name the package needs moved; it names each, its package's version, and the releases
            the package was written for.
    """
    required = look_up_private_names()
    if required:
        raise DependencyDriftError(drift_message(list(required)))
