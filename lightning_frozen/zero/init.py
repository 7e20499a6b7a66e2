"""``deepspeed.zero.Init``, the context under which modules are built as ZeRO-3 shards, and importing DeepSpeed.

While a ``zero.Init`` is active DeepSpeed patches ``nn.Module.__init__`` and torch's tensor constructors: each param
is partitioned as soon as its module is built, and new tensors get the config's dtype and device. Code that must
build ordinary tensors there (PEFT's adapter initialisation, the loader's checksum buffers) steps outside it for a
while (:func:`outside_zero_init`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch


@contextmanager
def sharded_creation(config: dict, remote_device: Optional[str]) -> Iterator[None]:
    """While active, params are ZeRO-3 shards as they are created, on ``remote_device`` (``"cpu"``; None: the
    accelerator), as the DeepSpeed ``config`` says (its dtype, its ZeRO-3 settings)."""
    import deepspeed

    with deepspeed.zero.Init(remote_device=remote_device, config_dict_or_path=config):
        yield


@contextmanager
def outside_zero_init() -> Iterator[None]:
    """While active, modules and tensors are built as ordinary ones even inside a ``zero.Init``; its patches are put
    back on exit. Does nothing outside a ``zero.Init`` or inside another :func:`outside_zero_init`, so it nests."""
    from deepspeed.runtime.zero import partition_parameters

    context = partition_parameters.top_level_context
    patched = context is not None and context.patched
    if patched:
        partition_parameters.shutdown_init_context()
    try:
        yield
    finally:
        if patched:
            partition_parameters.restore_init_context()


def import_with_logs_to_stderr() -> None:
    """Import DeepSpeed with stdout pointing at stderr: its logger keeps the stream it finds at import, so its lines
    (such as the accelerator it detected) go to stderr for the rest of the process. Does nothing once imported."""
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # noqa: F401


def linear_restorer() -> Callable[[], None]:
    """What puts ``torch.nn.functional.linear`` back as it is now, where a ``zero.Init`` replaced it since.

    ``zero.Init`` (with the config's ``memory_efficient_linear``, on by default) replaces it process-wide with
    DeepSpeed's ``zero3_linear_wrap`` and says it "will persist unless manually reset"; the next ``zero.Init``
    replaces it again. A replacement by anyone else is left alone.
    """
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    original = torch.nn.functional.linear

    def restore() -> None:
        if torch.nn.functional.linear is zero3_linear_wrap:
            torch.nn.functional.linear = original

    return restore
