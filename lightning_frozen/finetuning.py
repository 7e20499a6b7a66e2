"""Progressive unfreezing under ZeRO-3: ``BaseFinetuning`` and ``BackboneFinetuning`` that work with
``frozen_deepspeed``, Lightning's classes with the same names and API (import them from ``lightning_frozen``).

``finetune_function`` receives a stand-in optimizer from the strategy (:meth:`FrozenAwareDeepSpeedStrategy.finetune`),
which applies its change afterwards (a ZeRO-3 optimizer cannot ``add_param_group``), and ``freeze_before_training``
runs once ``configure_model`` has built the sharded model. docs/unfreezing.md tells the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import finetuning as lightning_finetuning
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from typing_extensions import override

from lightning_frozen import lightning_seam
from lightning_frozen.optim.unfreezing import StagedOptimizer
from lightning_frozen.strategy import FrozenAwareDeepSpeedStrategy


class BaseFinetuning(lightning_finetuning.BaseFinetuning):
    """Lightning's ``BaseFinetuning``, working under ``frozen_deepspeed`` (and unchanged under other strategies)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, FrozenAwareDeepSpeedStrategy):
            # the model is built later, in `configure_model`: the strategy freezes it then
            trainer.strategy.freeze_once_built(self.freeze_before_training)
            return
        super().setup(trainer, pl_module, stage)

    @staticmethod
    def filter_on_optimizer(optimizer: Any, params: Iterable) -> list:
        """The params not already in one of the optimizer's groups, by identity; warns as Lightning's does when some
        are skipped.

        Lightning compares values with ``torch.equal``, which under ZeRO-3 compares empty placeholders.
        """
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        kept = [p for p in params if id(p) not in present]
        if len(kept) < len(params):
            optimizer_class = getattr(optimizer, "optimizer_class", type(optimizer))
            rank_zero_warn(
                "The provided params to be frozen already exist within another group of this optimizer."
                " Those parameters will be skipped.\n"
                "HINT: Did you init your optimizer in `configure_optimizer` as such:\n"
                f" {optimizer_class}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
            )
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Union[Module, Iterable[Union[Module, Iterable]]],
        optimizer: Any,
        lr: Optional[float] = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze ``modules`` and add their params to ``optimizer`` as a new group, as Lightning's does."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = BaseFinetuning.filter_on_optimizer(optimizer, params)
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, FrozenAwareDeepSpeedStrategy):
            super().on_train_epoch_start(trainer, pl_module)
            return

        def finetune(optimizer: StagedOptimizer) -> None:  # Lightning's body, on the strategy's stand-in optimizer
            num_groups = len(optimizer.param_groups)
            self.finetune_function(pl_module, trainer.current_epoch, optimizer)
            lightning_seam.record_added_groups(self, pl_module, num_groups, optimizer.param_groups)

        strategy.finetune(finetune)


class BackboneFinetuning(BaseFinetuning, lightning_finetuning.BackboneFinetuning):
    """Lightning's ``BackboneFinetuning`` (same arguments), working under ``frozen_deepspeed``."""
