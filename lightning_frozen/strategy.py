"""``FrozenAwareDeepSpeedStrategy``: Lightning's DeepSpeed strategy, made to train a mostly frozen model well.

The class only wires the pieces into Lightning's hooks: argument checks live in ``arguments.py``, optimizer
stripping in ``optim.py``, the ZeRO-3 placement of frozen and trainable params in ``placement.py``, the trainable
state a checkpoint holds in ``trainable_state.py`` (the file itself in ``checkpoint.py``), the frozen base's
fingerprint in ``frozen_base.py``, changing what trains mid-run in ``unfreezing.py`` and memory accounting in
``memory.py``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning
from lightning.pytorch.core.optimizer import LRSchedulerConfig
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_frozen import (
    checkpoint,
    memory,
    optim,
    placement,
    pretrained,
    quant,
    schedulers,
    trainable_state,
    unfreezing,
    zero,
)
from lightning_frozen.arguments import check_config_for_accelerator, check_strategy_arguments
from lightning_frozen.errors import InvalidArgumentTypeError, UnsupportedConfigurationError
from lightning_frozen.frozen_base import FingerprintCache, named_frozen, verify_checkpoint_base

# A finetuning callback with this class attribute set to True unfreezes through `reconfigure_trainable` and has its
# `freeze_before_training(module)` called by the strategy once `configure_model` has built the model.
ZERO3_FINETUNING = "unfreezes_under_zero3"

# the names `import lightning_frozen` registers: (name, description, strategy arguments)
REGISTERED_NAMES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("frozen_deepspeed", "ZeRO-3, frozen params sharded and offloaded to CPU memory", {}),
    (
        "frozen_deepspeed_offload",
        "ZeRO-3, frozen shards in CPU memory, optimizer stepped on the CPU (ZeRO-Offload)",
        {"offload_optimizer": True},
    ),
    (
        "frozen_deepspeed_no_offload",
        "ZeRO-3, frozen params sharded and kept on the accelerator",
        {"offload_frozen": False},
    ),
)

if TYPE_CHECKING:
    import deepspeed
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry


class FrozenAwareDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO for models whose larger part is frozen.

    Compared with :class:`~lightning.pytorch.strategies.DeepSpeedStrategy` (whose arguments all keep working):

    - frozen params (``requires_grad=False``) are stripped from the optimizer ``configure_optimizers`` returns,
      so they never get gradients, fp32 master copies or optimizer state; groups whose learning rate is 0 for
      the whole run (the old ``lr=0`` freezing workaround) are frozen first;
    - under ZeRO-3 (the default here) frozen params are 1/N shards in the compute dtype, kept in CPU memory
      when ``offload_frozen=True``, while trainable params stay on the accelerator;
    - it runs on CUDA and on the CPU (DeepSpeed's CPU accelerator with gloo).

    Args:
        accelerator: the Lightning accelerator; normally chosen by the Trainer's ``accelerator=`` (``"gpu"`` or
            ``"cpu"``), and DeepSpeed's accelerator is set to match it.
        zero_optimization: use ZeRO; it must stay on, frozen params are sharded by ZeRO stage 3.
        stage: ZeRO stage; 3 shards frozen params across ranks.
        offload_frozen: keep the frozen ZeRO-3 shards in CPU memory (trainable params are not offloaded
            unless ``offload_parameters=True``, which offloads every param, as DeepSpeed does).
        offload_optimizer: step the optimizer on the CPU (ZeRO-Offload); a torch ``Adam``/``AdamW`` becomes
            DeepSpeed's CPU Adam with the same hyper-parameters.
        convert_lr_zero_groups: freeze params that sit only in groups whose learning rate is 0 for the whole run.
        frozen_base: a reference (path or hub id) to the frozen base, stored in checkpoints; found from the
            module when not given.
        fingerprint: how checkpoints verify the frozen base: ``"checksum"`` (every value, position-weighted,
            no gather), ``"sha256"`` (full hash of every frozen tensor, gathered one at a time) or ``"none"``.
        frozen_dtype: how frozen ZeRO-3 shards are stored: None (the compute dtype), ``"int8"`` (block-wise
            absmax, 256 weights per fp32 scale) or ``"nf4"`` (4-bit NormalFloat, 64 weights per fp16 scale);
            dequantized to the compute dtype when a layer is computed (see ``lightning_frozen.quant``).
        parallel_devices: the devices of this node's processes; normally set by the Trainer from ``devices=``.
        cluster_environment: where ranks, addresses and ports come from (torchrun, SLURM, ...); normally detected
            by the Trainer.
        precision_plugin: Lightning's precision plugin; normally set by the Trainer from ``precision=``.
        process_group_backend: the torch.distributed backend; ``nccl`` on CUDA and ``gloo`` on the CPU by default.
        timeout: how long collectives wait for the other ranks before failing.
        **kwargs: any other argument of :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`.
            ``exclude_frozen_parameters`` and ``load_full_weights`` have no effect here: checkpoints are always one
            adapter file without frozen weights.
    """

    strategy_name = "frozen_deepspeed"

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        zero_optimization: bool = True,
        stage: int = 3,
        offload_frozen: bool = True,
        offload_optimizer: bool = False,
        convert_lr_zero_groups: bool = True,
        frozen_base: Optional[str] = None,
        fingerprint: Literal["checksum", "sha256", "none"] = "checksum",
        frozen_dtype: Optional[Literal["int8", "nf4"]] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        flags = dict(zero_optimization=zero_optimization, offload_frozen=offload_frozen)
        flags.update(offload_optimizer=offload_optimizer, convert_lr_zero_groups=convert_lr_zero_groups)
        config = kwargs.get("config")
        check_strategy_arguments(
            flags, frozen_base, timeout, config, fingerprint, zero_optimization, stage, frozen_dtype
        )
        super().__init__(
            accelerator=accelerator,
            zero_optimization=zero_optimization,
            stage=stage,
            offload_optimizer=offload_optimizer,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )
        self.offload_frozen = offload_frozen
        self.offload_optimizer = offload_optimizer
        self.convert_lr_zero_groups = convert_lr_zero_groups
        self.frozen_base = frozen_base
        self.fingerprint = fingerprint
        self.frozen_dtype = frozen_dtype
        self.pin_memory = bool(kwargs.get("pin_memory", False))
        # ZeRO-3 allocates its gradient reduce bucket whole up front; only trainable grads ever go in it
        self._fit_reduce_bucket = "reduce_bucket_size" not in kwargs and config is None
        # the params and their requires_grad when the optimizer was built: checked every training step
        self._watched_params: list[tuple[str, Any]] = []
        self._trainable_flags: tuple[bool, ...] = ()
        self._group_param_names: list[list[str]] = []
        self._fingerprints = FingerprintCache()
        # trainable params in no optimizer group (plain torch never steps them) and the hooks that drop their grads
        self._ungrouped_names: list[str] = []
        self._ungrouped_hooks: list[Any] = []
        self._connected: Optional[weakref.ref[Module]] = None  # the module of the last run

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        for name, description, arguments in REGISTERED_NAMES:
            strategy_registry.register(name, cls, description=description, **arguments)

    # ------------------------------------------------------------------ one run's state

    @override
    def connect(self, model: pl.LightningModule) -> None:
        # Lightning connects the strategy at the start of every fit/validate/test/predict. The frozen base may have
        # changed since the last run, so its fingerprint is taken again; another module must not meet the previous
        # one's optimizer and param names (a save after `fit`, or after a `validate` of the same module, keeps them)
        self._fingerprints.clear()
        if self._connected is None or self._connected() is not model:
            self.optimizers = []
            self.lr_scheduler_configs = []
            self._watched_params, self._trainable_flags, self._group_param_names = [], (), []
        self._connected = weakref.ref(model)
        super().connect(model)

    @property
    def param_group_names(self) -> list[list[str]]:
        """The names of the params in each param group of the ZeRO optimizer, in group order."""
        return self._group_param_names

    # ------------------------------------------------------------------ environment

    @override
    def setup_environment(self) -> None:
        # DeepSpeed 0.19 and Lightning 2.6 call torch APIs that torch 2.13 deprecates, every step; not the user's to fix
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
        placement.align_deepspeed_accelerator(self.accelerator)
        check_config_for_accelerator(self.config, self.accelerator)
        for callback in self._callbacks():
            if isinstance(callback, LightningBaseFinetuning) and not getattr(callback, ZERO3_FINETUNING, False):
                raise UnsupportedConfigurationError(
                    f"Lightning's `{type(callback).__name__}` refuses every DeepSpeed strategy. Import"
                    " `BaseFinetuning`/`BackboneFinetuning` from `lightning_frozen` instead (same names and"
                    " arguments): they unfreeze and freeze params under ZeRO-3 by rebuilding the optimizer."
                )
        # DeepSpeedStrategy refuses anything but CUDA here; CPU training through DeepSpeed's CPU accelerator works.
        DDPStrategy.setup_environment(self)

    def _callbacks(self) -> list[Any]:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return list(trainer.callbacks) if trainer is not None else []

    def _freeze_for_finetuning_callbacks(self) -> None:
        """Our finetuning callbacks freeze here, after ``configure_model`` built the (sharded) model, where
        Lightning's freeze in their ``setup``, before it."""
        for callback in self._callbacks():
            if getattr(callback, ZERO3_FINETUNING, False):
                callback.freeze_before_training(self.lightning_module)

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            # CPU devices have no index, so DeepSpeedStrategy's device-index check does not apply.
            self.set_world_ranks()
            self._init_deepspeed_distributed()
            return
        super().setup_distributed()

    @property
    def _device_rank(self) -> int:
        index = self.root_device.index
        return index if index is not None else self.local_rank

    # ------------------------------------------------------------------ optimizer and engine

    @override
    def _init_optimizers(self) -> tuple[Optimizer, Optional[LRSchedulerConfig]]:
        self._freeze_for_finetuning_callbacks()
        optimizer, scheduler_config = super()._init_optimizers()
        scheduler = scheduler_config.scheduler if scheduler_config is not None else None
        module = self.lightning_module
        assert module is not None
        optimizer = optim.prepare_for_zero(
            module, optimizer, scheduler, self.convert_lr_zero_groups, type(self).__name__
        )
        if self.offload_optimizer:
            optimizer = optim.to_cpu_adam(optimizer, scheduler)
        names = {id(p): n for n, p in module.named_parameters()}
        self._group_param_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        return optimizer, scheduler_config

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optional[Optimizer], lr_scheduler: Optional[Any] = None
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer]:
        zero.check_has_trainable(model)
        if optimizer is not None:
            self._ungrouped_names, self._ungrouped_hooks = optim.leave_ungrouped_unstepped(
                model, optimizer, self._ungrouped_names, self._ungrouped_hooks
            )
        self._watched_params = list(model.named_parameters())
        self._trainable_flags = tuple(p.requires_grad for _, p in self._watched_params)
        if self._fit_reduce_bucket and self.zero_stage_3:
            placement.fit_reduce_bucket(self.config, sum(zero.full_numel(p) for p in optim.trainable_params(model)))
        return self._initialize_engine(model, self.config, optimizer, lr_scheduler, optim.trainable_params(model))

    def _initialize_engine(
        self, model: Module, config: Any, optimizer: Any, lr_scheduler: Any, model_parameters: list
    ) -> tuple[deepspeed.DeepSpeedEngine, Any]:
        if self.frozen_dtype:
            quant.check_config(self.frozen_dtype, config, self.root_device)
        engine, deepspeed_optimizer = placement.initialize_engine(
            model,
            config,
            self.root_device,
            self._device_rank,
            self.offload_frozen,
            self.pin_memory,
            self.zero_stage_3,
            optimizer,
            lr_scheduler,
            model_parameters,
        )
        if self.frozen_dtype:
            quant.quantize_frozen_shards(model, self.frozen_dtype, self.fingerprint)
        return engine, deepspeed_optimizer

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs here: params are ZeRO-3 shards as they are created (in CPU memory when frozen
        shards are offloaded; trainable ones move to the accelerator at setup), and ``from_pretrained`` loads each
        rank's slice of every tensor straight into its shard."""
        import deepspeed

        self._init_config_if_needed()
        remote_device = self.remote_device or ("cpu" if self.offload_frozen and self.zero_stage_3 else None)
        with (
            deepspeed.zero.Init(
                enabled=self.zero_stage_3, remote_device=remote_device, config_dict_or_path=self.config
            ),
            pretrained.zero3_pretrained_loading(self.config) if self.zero_stage_3 else nullcontext(),
            pretrained.peft_adapters_outside_zero_init() if self.zero_stage_3 else nullcontext(),
        ):
            yield

    @override
    def _initialize_deepspeed_train(self, model: Module) -> None:
        super()._initialize_deepspeed_train(model)
        if self.is_global_zero:
            rank_zero_info(self.memory_summary())
        # one pass over the frozen shards now, so that saving costs only the trainable state
        self.frozen_base_fingerprint()

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        self._freeze_for_finetuning_callbacks()
        assert isinstance(self.config, dict)
        remove_module_hooks(model)
        config = placement.inference_config(self.config, self.zero_stage_3)
        self.model, _ = self._initialize_engine(model, config, None, None, [])

    # ------------------------------------------------------------------ training

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        unfreezing.check_trainable_set_unchanged(self._watched_params, self._trainable_flags)
        return super().training_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Lightning kills the ranks its launcher started only on Ctrl+C: after any other failure here, a rank stuck
        # in a hang of its own would outlive the run (one waiting in a collective fails when this process exits)
        if isinstance(self.launcher, _SubprocessScriptLauncher):
            self.launcher.kill(_get_sigkill_signal())

    # ------------------------------------------------------------------ changing what trains

    def reconfigure_trainable(self, param_groups: list[dict[str, Any]], origins: list[Optional[int]]) -> None:
        """Rebuild the ZeRO optimizer for new param groups after params were unfrozen or frozen mid-run.

        ``param_groups`` is the whole new structure (params and hyper-parameters per group); ``origins[i]`` is the
        index of the current group that group ``i`` continues, or None for a new group (new groups come last).
        Params that stay trainable keep their fp32 master weight and optimizer state, frozen ones release theirs,
        newly trainable ones start fresh (see ``unfreezing.py``). Collective: every rank calls it with the same groups.
        """
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        module = self.lightning_module
        assert module is not None
        change = unfreezing.plan_change(module, param_groups, origins, self._group_param_names)
        carried = unfreezing.carry_state(self._deepspeed_optimizer, module, change.keep)
        optimizer = optim.same_kind_of_optimizer(self._deepspeed_optimizer.optimizer, change.groups)
        counters = {key: getattr(self.deepspeed_engine, key) for key in unfreezing.ENGINE_COUNTERS}
        num_old_groups = len(self._group_param_names)
        self.deepspeed_engine.destroy()
        remove_module_hooks(module)
        placement.detach_frozen_shards(change.refrozen, self.offload_frozen)
        self._group_param_names = change.group_names
        engine, deepspeed_optimizer = self._setup_model_and_optimizer(module, optimizer)
        for key, value in counters.items():
            setattr(engine, key, value)
        self.model = engine
        self.optimizers = [deepspeed_optimizer]
        if self.lr_scheduler_configs:
            scheduler = self.lr_scheduler_configs[0].scheduler
            schedulers.regroup_scheduler(scheduler, optimizer, change.continued, num_old_groups)
        rank_zero_info(change.summary(unfreezing.restore_state(deepspeed_optimizer, module, carried)))

    # ------------------------------------------------------------------ checkpoints

    @property
    def _deepspeed_optimizer(self) -> Any:
        return self.optimizers[0] if self.optimizers else None

    def frozen_base_fingerprint(
        self, named: Optional[list[tuple[str, Any]]] = None, mode: Optional[str] = None
    ) -> dict[str, Any]:
        """The fingerprint of the module's frozen params (default: all of them, in this strategy's mode).

        Collective. Computed once per set of names and mode: frozen params never change, so a resumed run verifies
        the base and writes its later checkpoints with one pass over the frozen shards.
        """
        module = self.lightning_module
        assert module is not None
        return self._fingerprints(named_frozen(module) if named is None else named, mode or self.fingerprint)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable params (whole fp32 values) and persistent buffers; never a frozen weight. Collective."""
        module = self.lightning_module
        assert module is not None
        return trainable_state.trainable_state_dict(module, self._deepspeed_optimizer, self._ungrouped_names)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by param name, whole tensors: any world size can resume it. Collective."""
        module = self.lightning_module
        assert module is not None
        return trainable_state.optimizer_state_by_name(optimizer, module, self._group_param_names)

    @override
    def save_checkpoint(self, checkpoint_dict: dict, filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write one file with the trainable state and the frozen base's reference and fingerprint, from rank 0:
        atomically to a local path or an fsspec URL, or through the Trainer's ``CheckpointIO`` plugin when one was
        given. Every rank must call it (the fingerprint is collective)."""
        if storage_options is not None and not self._custom_checkpoint_io:
            raise InvalidArgumentTypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` needs a `CheckpointIO` plugin that takes them"
                f" (`Trainer(plugins=[...])`); {type(self).__name__} writes the file itself otherwise."
            )
        filepath = self.broadcast(filepath)
        module = self.lightning_module
        assert module is not None
        entries = trainable_state.checkpoint_entries(
            module,
            self.frozen_base_fingerprint(),
            self.frozen_base,
            self.world_size,
            str(self.precision_plugin.precision),
            self.frozen_dtype,
        )
        checkpoint_dict = {**checkpoint_dict, **entries}
        if not self.is_global_zero:
            return
        plain = checkpoint.to_plain(checkpoint_dict)
        if self._custom_checkpoint_io:
            self.checkpoint_io.save_checkpoint(plain, filepath, storage_options=storage_options)
        else:
            checkpoint.write_atomic(plain, filepath)

    @property
    def _custom_checkpoint_io(self) -> bool:
        # a plugin the user chose (cloud storage, async saves) writes and reads; Lightning's default is replaced
        return type(self.checkpoint_io) is not TorchCheckpointIO

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a lightning-frozen file on every rank and verify the frozen base against it (collective)."""
        checkpoint_path = self.broadcast(checkpoint_path)
        if self._custom_checkpoint_io:
            loaded = self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=True)
            checkpoint.validate_checkpoint(loaded, checkpoint_path)
        else:
            loaded = checkpoint.read_checkpoint(checkpoint_path)
        quant.warn_if_stored_otherwise(loaded, self.frozen_dtype, checkpoint_path)
        if self.fingerprint != "none":
            module = self.lightning_module
            assert module is not None
            verify_checkpoint_base(loaded, module, str(checkpoint_path), fingerprint=self._fingerprints)
        return loaded

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if module.trainer.training and self._deepspeed_optimizer:
            # a finetuning callback may have unfrozen or frozen params since `configure_optimizers`: on resume, what
            # was trainable when the checkpoint was saved trains again, in the checkpoint's groups
            regrouped = unfreezing.groups_from_checkpoint(module, checkpoint_dict, len(self._group_param_names))
            if regrouped is not None:
                self.reconfigure_trainable(*regrouped)
        trainable_state.load_trainable_state(
            module, checkpoint_dict["state_dict"], self._deepspeed_optimizer, self._ungrouped_names, strict
        )

    @override
    def load_optimizer_state_dict(self, checkpoint_dict: Mapping[str, Any]) -> None:
        module = self.lightning_module
        assert module is not None
        saved = checkpoint_dict["optimizer_states"][0]
        trainable_state.load_optimizer_state_by_name(self._deepspeed_optimizer, module, saved)

    def memory_summary(self) -> str:
        """The per-rank memory summary logged on rank 0 at the start of ``fit``."""
        module = self.lightning_module
        assert module is not None
        return memory.run_summary(
            module,
            self._deepspeed_optimizer,
            world_size=self.world_size,
            ranks_per_node=self.num_processes,
            zero_stage_3=self.zero_stage_3,
            precision=str(self.precision_plugin.precision),
            offload_frozen=self.offload_frozen,
            offload_optimizer=self.offload_optimizer,
            frozen_dtype=self.frozen_dtype,
            compute_dtype=placement.compute_dtype(self.config or {}) or torch.float32,
        )
