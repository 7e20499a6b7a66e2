"""Progressive unfreezing under ZeRO-3: ``BaseFinetuning`` and ``BackboneFinetuning`` that work with
``frozen_deepspeed``.

They are Lightning's classes with the same names and API; import them from ``lightning_frozen`` instead of
``lightning.pytorch.callbacks``. Lightning's own refuse every DeepSpeed strategy in ``setup``, and their
``unfreeze_and_add_param_group`` calls ``optimizer.add_param_group``, which a ZeRO-3 optimizer cannot honour:
its fp32 partitions are fixed when DeepSpeed initialises. Here ``finetune_function`` receives a stand-in
optimizer with the same ``param_groups`` and ``add_param_group``, from the strategy
(:meth:`FrozenAwareDeepSpeedStrategy.finetune`); when it returns, the strategy applies it: changed hyper-parameters go
to the real optimizer, and a changed trainable set rebuilds the ZeRO optimizer, carrying over the state of every param
that keeps training. The callback calls the strategy (``freeze_once_built`` from ``setup``, ``finetune`` at each
epoch's start); the strategy needs no marker on it.

Two differences from Lightning's, both for ZeRO-3: ``freeze_before_training`` runs once ``configure_model`` has built
the (sharded) model, where Lightning's runs in ``setup``, before it; and a param left trainable in no group (the
BatchNorm params ``train_bn=True`` keeps trainable in a frozen backbone) is never stepped, as in plain PyTorch, with a
notice that names it, until ``unfreeze_and_add_param_group`` adds it.

A resumed run learns what was unfrozen from the checkpoint itself: its ``state_dict`` holds every param that was
trainable when it was saved, and ``optimizer_states[0]["param_groups"]`` their groups by name; the strategy makes
exactly those trainable again before loading the optimizer state.
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
