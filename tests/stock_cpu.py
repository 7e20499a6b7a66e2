"""Lightning's own ``DeepSpeedStrategy`` with only its CUDA checks lifted, so stock runs on this CPU: the tests'
stock DeepSpeed checkpoints and the benchmarks' baseline.

The three overrides are the ones ``lightning_frozen/strategy.py`` makes; nothing else changes, so optimizer
handling, ZeRO config and checkpoints are stock Lightning 2.6 + DeepSpeed.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    @override
    def setup_environment(self) -> None:
        # DeepSpeedStrategy refuses anything but CUDA here; skip to DDPStrategy's environment setup.
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        # CPU devices have no index, so `_validate_device_index_selection` does not apply.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optional[Optimizer], lr_scheduler: Optional[Any] = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        # stock passes `root_device.index`, which is None on the CPU
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer


def stage_3_offload() -> CPUDeepSpeedStrategy:
    """The settings of Lightning's registered ``deepspeed_stage_3_offload``."""
    return CPUDeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
