"""The Lightning seam: every private name of Lightning the package relies on, in one module, written for Lightning 2.6
(2.6.6 tested). When Lightning changes, this is the one place to look; each name is a row of ``capabilities.py``,
reached through its module at call time, so that a moved one meets that check rather than failing the import.
docs/internals.md lists them with why each is needed.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.connectors import signal_connector
from torch.nn import Module
from typing_extensions import override

from lightning_frozen import process

_TRAINER_RUN = getattr(getattr(pl.Trainer, "_run", None), "__code__", None)


# what Lightning's launcher and DeepSpeedStrategy set in os.environ to start a world
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE")


class WorldStartedHere(LightningEnvironment):
    """Lightning's own environment, leaving nothing of its rendezvous behind. Without ``MASTER_PORT`` (or Lightning's
    ``STANDALONE_PORT``) set, rank 0 listens on a port below the kernel's ephemeral range
    (:func:`process.rendezvous_port`). A one-rank run puts the variables Lightning set back as its launch found them
    at :meth:`teardown`; a world of several ranks keeps them, as the next Trainer of the script meets in it."""

    def __init__(self) -> None:
        super().__init__()
        self._port: Optional[int] = None
        self._found: Optional[dict[str, Optional[str]]] = None

    @property
    @override
    def creates_processes_externally(self) -> bool:
        external = super().creates_processes_externally
        if not external:  # asked by the launch, before Lightning's launcher sets the variables
            self._found = {name: os.environ.get(name) for name in RENDEZVOUS_VARIABLES}
        return external

    @property
    @override
    def main_port(self) -> int:
        if self._port is None:
            if "MASTER_PORT" in os.environ:
                self._port = int(os.environ["MASTER_PORT"])
            else:
                self._port = find_free_network_port() if "STANDALONE_PORT" in os.environ else process.rendezvous_port()
        return self._port

    @override
    def teardown(self) -> None:
        super().teardown()
        if self._found is not None and self.world_size() == 1:
            for name, value in self._found.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self._port = self._found = None


class DeepSpeedHooks(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` whose private hooks call public methods: override ``build_optimizer`` and
    ``build_engine`` (calling ``super()`` for Lightning's own step). Lightning's own environment, given by the Trainer
    or the user, becomes a :class:`WorldStartedHere`."""

    @property
    def cluster_environment(self) -> Optional[ClusterEnvironment]:
        return self._environment

    @cluster_environment.setter
    def cluster_environment(self, environment: Optional[ClusterEnvironment]) -> None:
        self._environment = WorldStartedHere() if type(environment) is LightningEnvironment else environment

    def start_deepspeed_distributed(self) -> None:
        """DeepSpeed's process group, as ``DeepSpeedStrategy.setup_distributed`` starts it."""
        self._init_deepspeed_distributed()

    @override
    def _init_deepspeed_distributed(self) -> None:
        if self.world_size == 1 and not dist.is_initialized():
            # one rank meets no one: a store in memory, not a TCP store listening on MASTER_PORT after the run
            backend = self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        super()._init_deepspeed_distributed()

    def complete_config(self) -> None:
        """The DeepSpeed config completed from the Trainer (batch size, precision), once."""
        self._init_config_if_needed()

    @override
    def _init_config_if_needed(self) -> None:
        try:
            super()._init_config_if_needed()
        except AttributeError as error:
            # Lightning reads the micro-batch size DeepSpeed logs throughput with from the train loader's batch
            # sampler, which a `DataLoader(batch_size=None)` (a stream of whole batches) has not, stock too: 1, as
            # where there is no loader, unless `logging_batch_size_per_gpu` gives it
            if "batch_size" not in str(error) or "train_micro_batch_size_per_gpu" in self.config:
                raise
            self.config.pop("gradient_accumulation_steps")  # Lightning's, set just before: it refuses one given
            self.config["train_micro_batch_size_per_gpu"] = 1
            super()._init_config_if_needed()

    def build_optimizer(self) -> tuple[Any, Any]:
        """The optimizer and LR scheduler config of ``configure_optimizers``, as Lightning builds them."""
        return super()._init_optimizers()

    def build_engine(self, model: Module, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        """The DeepSpeed engine over ``model`` and its ZeRO optimizer."""
        return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    @override
    def _init_optimizers(self) -> tuple[Any, Any]:
        return self.build_optimizer()

    @override
    def _setup_model_and_optimizer(self, model: Module, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        return self.build_engine(model, optimizer, lr_scheduler)


def record_added_groups(callback: Any, pl_module: Any, num_groups: int, groups: Sequence[dict]) -> None:
    """What Lightning's ``BaseFinetuning`` does after its ``finetune_function``: remember the groups added past
    ``num_groups``, so that its checkpoint state holds them."""
    callback._store(pl_module, 0, num_groups, groups)


def resolved_ckpt_path(trainer: pl.Trainer) -> Any:
    """The ``ckpt_path`` the running ``fit``/``validate``/``test``/``predict`` of ``trainer`` will restore, as
    Lightning resolved it; None when there is none or it cannot be read."""
    frame = inspect.currentframe() if _TRAINER_RUN is not None else None
    while frame is not None and not (frame.f_code is _TRAINER_RUN and frame.f_locals.get("self") is trainer):
        frame = frame.f_back
    return frame.f_locals.get("ckpt_path") if frame is not None else None


def is_lightnings_signal_handler(handler: Any) -> bool:
    """Whether ``handler`` is a bound method of Lightning's signal connector."""
    return isinstance(getattr(handler, "__self__", None), signal_connector._SignalConnector)


def requeue(trainer: pl.Trainer, signum: int) -> None:
    """Lightning's SLURM requeue: loggers finalized, ``hpc_ckpt_<n>.ckpt`` saved by every rank in the Trainer's
    ``default_root_dir``, ``scontrol requeue``."""
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)


def register_no_signal_handlers(trainer: pl.Trainer, off: bool) -> None:
    """Keep Lightning's signal connector from registering its handlers (``off``), or let it again. Lightning
    registers them in ``Trainer._run`` after the strategy's setup, ahead of the strategy's; its SIGTERM handler
    broadcasts inside the handler, and they would run first in a window of every run."""
    connector = trainer._signal_connector
    if off:
        connector.register_signal_handlers = _register_nothing
    else:
        vars(connector).pop("register_signal_handlers", None)


def _register_nothing() -> None:
    """What Lightning's signal connector registers in a run whose strategy handles its signals itself."""
