"""``FrozenAwareDeepSpeedStrategy``: Lightning's DeepSpeed strategy, made to train a mostly frozen model well.

The class only wires the pieces into Lightning's hooks: optimizer stripping lives in ``optim.py``, the ZeRO-3
placement of frozen and trainable params in ``zero.py``, memory accounting in ``memory.py`` and the checkpoint
file in ``checkpoint.py``.
"""

from __future__ import annotations

import argparse
import os
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
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.core.optimizer import LRSchedulerConfig
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_frozen import base, checkpoint, memory, optim, pretrained, quant, zero
from lightning_frozen.errors import (
    CheckpointFormatError,
    FrozenSetChangedError,
    InvalidArgumentTypeError,
    InvalidArgumentValueError,
    NoTrainableParametersError,
    UnsupportedConfigurationError,
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
        _check_argument_types(flags, frozen_base, timeout, kwargs.get("config"))
        if fingerprint not in base.FINGERPRINT_MODES:
            raise InvalidArgumentValueError(f"`fingerprint={fingerprint!r}` is not one of {base.FINGERPRINT_MODES}.")
        quant.check_frozen_dtype(frozen_dtype)
        if zero_optimization and stage != 3:
            raise InvalidArgumentValueError(
                f"FrozenAwareDeepSpeedStrategy shards frozen params with ZeRO stage 3; got `stage={stage!r}`. Use"
                " Lightning's `DeepSpeedStrategy` for stages 1 and 2."
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
        self._fit_reduce_bucket = "reduce_bucket_size" not in kwargs and kwargs.get("config") is None
        # the params and their requires_grad when the optimizer was built: checked every training step
        self._watched_params: list[tuple[str, Any]] = []
        self._trainable_flags: tuple[bool, ...] = ()
        self._group_param_names: list[list[str]] = []
        self._fingerprint_cache: Optional[tuple[tuple[str, ...], dict[str, Any]]] = None
        # trainable params in no optimizer group (plain torch never steps them) and the hooks that drop their grads
        self._ungrouped_names: list[str] = []
        self._ungrouped_hooks: list[Any] = []
        self._connected: Optional[weakref.ref[Module]] = None  # the module of the last run

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register(
            "frozen_deepspeed", cls, description="ZeRO-3, frozen params sharded and offloaded to CPU memory"
        )
        strategy_registry.register(
            "frozen_deepspeed_offload",
            cls,
            description="ZeRO-3, frozen shards in CPU memory, optimizer stepped on the CPU (ZeRO-Offload)",
            offload_optimizer=True,
        )
        strategy_registry.register(
            "frozen_deepspeed_no_offload",
            cls,
            description="ZeRO-3, frozen params sharded and kept on the accelerator",
            offload_frozen=False,
        )

    # ------------------------------------------------------------------ one run's state

    @override
    def connect(self, model: pl.LightningModule) -> None:
        # Lightning connects the strategy at the start of every fit/validate/test/predict. The frozen base may have
        # changed since the last run, so its fingerprint is taken again; another module must not meet the previous
        # one's optimizer and param names (a save after `fit`, or after a `validate` of the same module, keeps them)
        self._fingerprint_cache = None
        if self._connected is None or self._connected() is not model:
            self.optimizers = []
            self.lr_scheduler_configs = []
            self._watched_params, self._trainable_flags, self._group_param_names = [], (), []
        self._connected = weakref.ref(model)
        super().connect(model)

    # ------------------------------------------------------------------ environment

    @override
    def setup_environment(self) -> None:
        # DeepSpeed 0.19 and Lightning 2.6 call torch APIs that torch 2.13 deprecates, every step; not the user's to fix
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
        zero.align_deepspeed_accelerator(self.accelerator)
        zero_config = (self.config or {}).get("zero_optimization") or {}
        if zero_config.get("zero_quantized_nontrainable_weights") and not isinstance(self.accelerator, CUDAAccelerator):
            raise UnsupportedConfigurationError(
                "`zero_quantized_nontrainable_weights` stores frozen weights in int8 with DeepSpeed's CUDA kernels,"
                f" which do not run on `{type(self.accelerator).__name__}`. Remove it from the DeepSpeed config and"
                " pass `frozen_dtype='int8'` (or `'nf4'`) to the strategy, which runs on the CPU too, or train with"
                " `accelerator='gpu'`."
            )
        self._check_finetuning_callbacks()
        # DeepSpeedStrategy refuses anything but CUDA here; CPU training through DeepSpeed's CPU accelerator works.
        DDPStrategy.setup_environment(self)

    def _check_finetuning_callbacks(self) -> None:
        from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning

        from lightning_frozen.finetuning import BaseFinetuning

        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        for callback in trainer.callbacks if trainer is not None else []:
            if isinstance(callback, LightningBaseFinetuning) and not isinstance(callback, BaseFinetuning):
                raise UnsupportedConfigurationError(
                    f"Lightning's `{type(callback).__name__}` refuses every DeepSpeed strategy. Import"
                    " `BaseFinetuning`/`BackboneFinetuning` from `lightning_frozen` instead (same names and"
                    " arguments): they unfreeze and freeze params under ZeRO-3 by rebuilding the optimizer."
                )

    def _freeze_for_finetuning_callbacks(self) -> None:
        """lightning_frozen's finetuning callbacks freeze here, after ``configure_model`` built the model (sharded),
        where Lightning's freeze in their ``setup``, before it."""
        from lightning_frozen.finetuning import BaseFinetuning

        module = self.lightning_module
        assert module is not None
        for callback in module.trainer.callbacks:
            if isinstance(callback, BaseFinetuning):
                callback.freeze_before_training(module)

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
        report = optim.prepare_optimizer(module, optimizer, scheduler, self.convert_lr_zero_groups)
        if report.lr_zero_params:
            rank_zero_info(
                f"lightning-frozen: froze {report.lr_zero_params} parameter tensors ({report.lr_zero_numel:,} elements)"
                " whose learning rate is 0 for the whole run (the `lr=0` workaround); they get no gradient or"
                " optimizer state. Pass `convert_lr_zero_groups=False` to keep them in the optimizer."
            )
        zero.check_has_trainable(module)
        if not optim.frozen_params(module):
            rank_zero_warn(
                f"lightning-frozen: every parameter of `{type(module).__name__}` is trainable, so"
                f" {type(self).__name__} brings nothing over plain ZeRO-3 (it saves optimizer state, gradients and"
                " checkpoint size of frozen parameters only). Freeze the base before `fit` (`requires_grad_(False)`,"
                " or wrap the model with PEFT), or train with `strategy='deepspeed_stage_3'`."
            )
        if not optimizer.param_groups:
            raise NoTrainableParametersError(
                f"The {type(optimizer).__name__} returned by `configure_optimizers` holds only frozen parameters"
                " (`requires_grad=False`), so nothing would train. Pass the trainable parameters to it, e.g."
                " `[p for p in self.parameters() if p.requires_grad]`."
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
        import deepspeed

        zero.check_has_trainable(model)
        if optimizer is not None:
            self._leave_ungrouped_unstepped(model, optimizer)
        self._watched_params = list(model.named_parameters())
        self._trainable_flags = tuple(p.requires_grad for _, p in self._watched_params)
        if self._fit_reduce_bucket and self.zero_stage_3:
            zero.fit_reduce_bucket(self.config, sum(zero.full_numel(p) for p in optim.trainable_params(model)))
        if self.frozen_dtype:
            quant.check_config(self.frozen_dtype, self.config, self.root_device)
        if self.zero_stage_3:
            zero.partition_frozen_and_trainable(model, self.config, self.offload_frozen, self.pin_memory)
        self._place(model)
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=self.config,
            model=model,
            model_parameters=optim.trainable_params(model),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        if self.zero_stage_3:
            zero.release_frozen_persistence(engine, model)
        if self.frozen_dtype:
            quant.quantize_frozen_shards(model, self.frozen_dtype, self.fingerprint)
        return engine, deepspeed_optimizer

    def _place(self, model: Module) -> None:
        """Shards and buffers where they belong, also for a model built under ``zero.Init`` in ``configure_model``."""
        offload_param = ((self.config or {}).get("zero_optimization") or {}).get("offload_param")
        if self.zero_stage_3 and not offload_param:
            dtype = zero.compute_dtype(self.config) or torch.float32
            zero.place_shards(model, self.root_device, self.offload_frozen, dtype)
        zero.place_buffers(model, self.root_device)

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

    def _leave_ungrouped_unstepped(self, model: Module, optimizer: Optimizer) -> None:
        """Trainable params outside every group train as in plain torch: never stepped. ZeRO-3 would keep their whole
        gradients forever, so they are dropped as they come."""
        for handle in self._ungrouped_hooks:
            handle.remove()
        names = optim.ungrouped_trainable_names(model, optimizer)
        params = dict(model.named_parameters())
        self._ungrouped_hooks = optim.discard_gradients([params[n] for n in names])
        if names and names != self._ungrouped_names:
            rank_zero_info(
                f"lightning-frozen: {_names(names)} require grad but are in no optimizer param group, so they are"
                " never stepped (as in plain PyTorch); a finetuning callback may add them to a group later."
            )
        self._ungrouped_names = names

    @override
    def _initialize_deepspeed_train(self, model: Module) -> None:
        super()._initialize_deepspeed_train(model)
        if self.is_global_zero:
            rank_zero_info(self.memory_summary())
        # one pass over the frozen shards now, so that saving costs only the trainable state
        self.frozen_base_fingerprint()

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        self._freeze_for_finetuning_callbacks()
        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
            inference_config["zero_optimization"] = self.config["zero_optimization"]
            zero.partition_frozen_and_trainable(model, inference_config, self.offload_frozen, self.pin_memory)
        if self.frozen_dtype:
            quant.check_config(self.frozen_dtype, inference_config, self.root_device)
        self._place(model)
        remove_module_hooks(model)
        engine, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        if self.zero_stage_3:
            zero.release_frozen_persistence(engine, model)
        if self.frozen_dtype:
            quant.quantize_frozen_shards(model, self.frozen_dtype, self.fingerprint)
        self.model = engine

    # ------------------------------------------------------------------ training

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._check_trainable_set_unchanged()
        return super().training_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Lightning kills the ranks its launcher started only on Ctrl+C: after any other failure here, a rank stuck
        # in a hang of its own would outlive the run (one waiting in a collective fails when this process exits)
        if isinstance(self.launcher, _SubprocessScriptLauncher):
            self.launcher.kill(_get_sigkill_signal())

    def _check_trainable_set_unchanged(self) -> None:
        if tuple(p.requires_grad for _, p in self._watched_params) == self._trainable_flags:
            return
        changed = [
            (name, param.requires_grad)
            for (name, param), was in zip(self._watched_params, self._trainable_flags)
            if param.requires_grad != was
        ]
        unfrozen = [name for name, now in changed if now]
        frozen = [name for name, now in changed if not now]
        raise FrozenSetChangedError(
            "The set of trainable parameters changed during training:"
            + (f" unfrozen {_names(unfrozen)};" if unfrozen else "")
            + (f" frozen {_names(frozen)};" if frozen else "")
            + " the ZeRO optimizer was built for the set at the start of `fit`, so these would be silently"
            " ignored or trained without state. Set `requires_grad` before `fit`, or change it mid-run through"
            " `lightning_frozen.BaseFinetuning` / `BackboneFinetuning`, which rebuild the optimizer."
        )

    # ------------------------------------------------------------------ changing what trains

    def reconfigure_trainable(self, param_groups: list[dict[str, Any]], origins: list[Optional[int]]) -> None:
        """Rebuild the ZeRO optimizer for new param groups after params were unfrozen or frozen mid-run.

        ``param_groups`` is the whole new structure (params and hyper-parameters per group); ``origins[i]`` is the
        index of the current group that group ``i`` continues, or None for a new group (new groups come last).
        Params that stay trainable keep their fp32 master weight and optimizer state; params that are frozen leave
        the optimizer and release their state; newly trainable params start with fresh state. DeepSpeed cannot add
        or remove params of an initialised ZeRO-3 optimizer, so the engine is destroyed and initialised again over
        the same (already partitioned) module. Collective: every rank must call it with the same groups.

        Params made trainable but put in no group are never stepped, as in plain torch.
        """
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        module = self.lightning_module
        assert module is not None
        params = dict(module.named_parameters())
        names = {id(p): n for n, p in params.items()}
        kept_groups = [(g, o) for g, o in zip(param_groups, origins) if any(p.requires_grad for p in g["params"])]
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g, _ in kept_groups]
        group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        new_set = {n for group in group_names for n in group}
        old_optimizer = self._deepspeed_optimizer
        old_names = [n for group in self._group_param_names for n in group]
        keep = [n for n in old_names if n in new_set]
        weights = {n: zero.full_param(params[n], old_optimizer) for n in keep}
        states = {n: zero.optimizer_state_of(old_optimizer, params[n]) for n in keep}
        refrozen = [params[n] for n in old_names if n not in new_set]
        added = sorted(new_set - set(old_names))
        optimizer = optim.same_kind_of_optimizer(old_optimizer.optimizer, groups)

        old_engine = self.deepspeed_engine
        counters = {
            k: getattr(old_engine, k) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")
        }
        num_old_groups = len(self._group_param_names)
        old_engine.destroy()
        remove_module_hooks(module)
        zero.detach_frozen_shards(refrozen, self.offload_frozen)
        self._group_param_names = group_names
        engine, deepspeed_optimizer = self._setup_model_and_optimizer(module, optimizer)
        for key, value in counters.items():
            setattr(engine, key, value)
        self.model = engine
        self.optimizers = [deepspeed_optimizer]
        if self.lr_scheduler_configs:
            kept = [o for _, o in kept_groups if o is not None]
            optim.regroup_scheduler(self.lr_scheduler_configs[0].scheduler, optimizer, kept, num_old_groups)
        for name in keep:
            zero.set_full_param(params[name], weights[name], deepspeed_optimizer)
        with_state = [n for n in keep if states[n]]
        zero.ensure_optimizer_state(deepspeed_optimizer, [params[n] for n in with_state])
        for name in with_state:
            zero.set_optimizer_state(deepspeed_optimizer, params[name], states[name])
        rank_zero_info(
            f"lightning-frozen: trainable set changed: {len(added)} tensors unfrozen, {len(refrozen)} frozen;"
            f" optimizer rebuilt with {len(groups)} param groups, state of {len(with_state)} tensors carried over."
        )

    def _adopt_trainable_set_of(self, checkpoint_dict: Mapping[str, Any]) -> None:
        """On resume, make trainable what was trainable when the checkpoint was saved (a finetuning callback may
        have unfrozen or frozen params since ``configure_optimizers``); the groups come from the checkpoint."""
        module = self.lightning_module
        assert module is not None
        params = dict(module.named_parameters())
        saved_groups = (checkpoint_dict.get("optimizer_states") or [{}])[0].get("param_groups")
        saved = {n for n in checkpoint_dict["state_dict"] if n in params}
        current = {n for n, p in params.items() if p.requires_grad}
        if not saved_groups or saved == current or not self._deepspeed_optimizer:
            return
        for name, param in params.items():
            param.requires_grad_(name in saved)
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [params[n] for n in group["params"]]}
            for group in saved_groups
        ]
        num_current = len(self._group_param_names)
        origins = [i if i < num_current else None for i in range(len(groups))]
        self.reconfigure_trainable(groups, origins)

    # ------------------------------------------------------------------ checkpoints

    @property
    def _deepspeed_optimizer(self) -> Any:
        return self.optimizers[0] if self.optimizers else None

    def _optimizer_holding(self, name: str) -> Any:
        """The ZeRO optimizer if it holds the param (and its fp32 master copy), else None."""
        return None if name in self._ungrouped_names else self._deepspeed_optimizer

    def _named_frozen(
        self, recorded: Optional[Mapping[str, Any]] = None, trained: Optional[Mapping[str, Any]] = None
    ) -> list[tuple[str, Any]]:
        module = self.lightning_module
        assert module is not None
        return checkpoint._named_frozen(module, recorded or {}, trained or {})

    def frozen_base_fingerprint(
        self, named: Optional[list[tuple[str, Any]]] = None, mode: Optional[str] = None
    ) -> dict[str, Any]:
        """The fingerprint of the module's frozen params (default: all of them, in this strategy's mode).

        Collective. Computed once per set of names and mode: frozen params never change, so a resumed run verifies
        the base and writes its later checkpoints with one pass over the frozen shards.
        """
        named = self._named_frozen() if named is None else named
        mode = mode or self.fingerprint
        key = (mode, *(name for name, _ in named))
        if self._fingerprint_cache is None or self._fingerprint_cache[0] != key:
            self._fingerprint_cache = (key, base.fingerprint_base(named, mode))
        return self._fingerprint_cache[1]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable params (whole fp32 values) and persistent buffers; never a frozen weight. Collective."""
        module = self.lightning_module
        assert module is not None
        state = {
            name: zero.full_param(param, self._optimizer_holding(name))
            for name, param in module.named_parameters()
            if param.requires_grad
        }
        state.update(
            {name: buffer.detach().cpu().clone() for name, buffer in checkpoint.persistent_buffers(module).items()}
        )
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by param name, whole tensors: any world size can resume it. Collective."""
        module = self.lightning_module
        assert module is not None
        params = dict(module.named_parameters())
        groups = []
        for group, names in zip(optimizer.param_groups, self._group_param_names):
            hyper = {key: value for key, value in group.items() if key != "params"}
            groups.append({**hyper, "params": list(names)})
        state = {
            name: zero.optimizer_state_of(optimizer, params[name])
            for names in self._group_param_names
            for name in names
        }
        return {
            "layout": checkpoint.OPTIMIZER_LAYOUT,
            "state": state,
            "param_groups": groups,
            "loss_scaler": zero.loss_scaler_state(optimizer),
        }

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
        trainable_names = [name for name, param in module.named_parameters() if param.requires_grad]
        checkpoint_dict = dict(checkpoint_dict)
        checkpoint_dict["frozen_base"] = checkpoint.frozen_base_entry(
            module, self.frozen_base_fingerprint(), self.frozen_base, trainable_names
        )
        if self.frozen_dtype:
            checkpoint_dict["frozen_base"]["quantization"] = quant.block_format(self.frozen_dtype).describe()
        checkpoint_dict[checkpoint.FORMAT_KEY] = {
            "format_version": checkpoint.FORMAT_VERSION,
            "world_size": self.world_size,
            "precision": str(self.precision_plugin.precision),
        }
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
        frozen_base = loaded["frozen_base"]
        trained_as = (frozen_base.get("quantization") or {}).get("dtype")
        if trained_as != self.frozen_dtype:
            rank_zero_warn(
                f"lightning-frozen: {checkpoint_path} was trained on a frozen base stored as"
                f" {trained_as or 'unquantized'}, this run stores it as {self.frozen_dtype or 'unquantized'}"
                " (`frozen_dtype`): the adapter sees slightly different base weights than it was trained on."
            )
        if self.fingerprint != "none":
            recorded = frozen_base.get("fingerprint") or {}
            base.verify_base(
                recorded,
                self._named_frozen(recorded, loaded["state_dict"]),
                frozen_base.get("reference"),
                str(checkpoint_path),
                fingerprint=self.frozen_base_fingerprint,
            )
        return loaded

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        if module.trainer.training:
            self._adopt_trainable_set_of(checkpoint_dict)
        state_dict = checkpoint_dict["state_dict"]
        params = dict(module.named_parameters())
        buffers = checkpoint.persistent_buffers(module)
        trainable = {name: param for name, param in params.items() if param.requires_grad}
        if strict:
            checkpoint.check_keys(state_dict, trainable, buffers, "the checkpoint")
        for name, value in state_dict.items():
            if name in trainable:
                zero.set_full_param(trainable[name], value, self._optimizer_holding(name))
            elif name in buffers:
                buffers[name].data.copy_(value.to(device=buffers[name].device, dtype=buffers[name].dtype))

    @override
    def load_optimizer_state_dict(self, checkpoint_dict: Mapping[str, Any]) -> None:
        saved = checkpoint_dict["optimizer_states"][0]
        optimizer = self._deepspeed_optimizer
        if saved.get("layout") != checkpoint.OPTIMIZER_LAYOUT:
            raise CheckpointFormatError(
                "The checkpoint's optimizer state is not keyed by parameter name; it was not written by"
                " lightning-frozen. Convert it with `lightning-frozen convert`."
            )
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointFormatError(
                f"The checkpoint's optimizer has {len(saved['param_groups'])} param groups, the one"
                f" `configure_optimizers` built now has {len(optimizer.param_groups)}. Resume with the same"
                " optimizer configuration and the same frozen/trainable split."
            )
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
        module = self.lightning_module
        assert module is not None
        params = dict(module.named_parameters())
        zero.ensure_optimizer_state(optimizer)
        for name, state in saved["state"].items():
            if name in params and params[name].requires_grad and state:
                zero.set_optimizer_state(optimizer, params[name], state)
        zero.restore_loss_scaler(optimizer, saved.get("loss_scaler") or {})

    def memory_summary(self) -> str:
        """The per-rank memory summary logged on rank 0 at the start of ``fit``."""
        module = self.lightning_module
        assert module is not None
        trainable = optim.trainable_params(module)
        frozen = optim.frozen_params(module)
        deepspeed_optimizer = self.optimizers[0] if self.optimizers else None
        inner = getattr(deepspeed_optimizer, "optimizer", deepspeed_optimizer)
        estimate = memory.estimate_from_counts(
            trainable_params=sum(zero.full_numel(p) for p in trainable),
            frozen_params=sum(zero.full_numel(p) for p in frozen),
            world_size=self.world_size if self.zero_stage_3 else 1,
            precision=str(self.precision_plugin.precision),
            offload_frozen=self.offload_frozen,
            offload_optimizer=self.offload_optimizer,
            optimizer_state_bytes=optim.optimizer_state_bytes_per_param(inner),
            largest_module_params=memory.largest_module_params(module),
            ranks_per_node=self.num_processes if self.zero_stage_3 else 1,
            frozen_dtype=self.frozen_dtype,
        )
        shard_bytes, shard_device = memory.measured_frozen_shard_bytes(frozen)
        return (
            f"lightning-frozen: {estimate.trainable_params:,} trainable / {estimate.frozen_params:,} frozen params"
            f" on {self.world_size} rank(s). Per rank: frozen shards {memory.format_bytes(shard_bytes)}"
            f" ({self.frozen_dtype or _dtype_name(zero.compute_dtype(self.config) or torch.float32)}) in"
            f" {shard_device} memory, trainable weights"
            f" {memory.format_bytes(estimate.trainable_weights)},"
            f" optimizer state (fp32 master + moments) {memory.format_bytes(estimate.optimizer_state)} on"
            f" {'host' if self.offload_optimizer else 'device'}; the `lr=0` workaround would have added"
            f" {memory.format_bytes(estimate.lr_zero_workaround_extra)} of optimizer state and gradients. Loading the"
            f" base in `configure_model` needs about {memory.format_bytes(estimate.host_load_bytes)} of host memory"
            f" per node ({estimate.ranks_per_node} rank(s), each with"
            f" {memory.format_bytes(estimate.load_in_flight)} in flight)."
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_argument_types(flags: dict[str, Any], frozen_base: Any, timeout: Any, config: Any) -> None:
    """A ``TypeError`` naming the strategy argument of the wrong type (the CLI checks types; Python callers not)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidArgumentTypeError(
                f"FrozenAwareDeepSpeedStrategy: `{name}` must be True or False, got {value!r}."
            )
    if frozen_base is not None and not isinstance(frozen_base, (str, os.PathLike)):
        raise InvalidArgumentTypeError(
            f"FrozenAwareDeepSpeedStrategy: `frozen_base` must be the base's path or hub id, got {frozen_base!r}."
        )
    if timeout is not None and not isinstance(timeout, timedelta):
        raise InvalidArgumentTypeError(
            f"FrozenAwareDeepSpeedStrategy: `timeout` must be a `datetime.timedelta`, e.g. `timedelta(minutes=10)`,"
            f" got {timeout!r}."
        )
    if config is not None and not isinstance(config, (str, os.PathLike, dict)):
        raise InvalidArgumentTypeError(
            f"FrozenAwareDeepSpeedStrategy: `config` must be a DeepSpeed config dict or the path of its JSON file,"
            f" got {config!r}."
        )
