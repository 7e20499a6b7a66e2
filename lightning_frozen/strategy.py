"""``FrozenAwareDeepSpeedStrategy``: Lightning's DeepSpeed strategy, made to train a mostly frozen model well.

The class only wires the package's modules into Lightning's hooks; docs/internals.md's module map says which does what.
"""

from __future__ import annotations

import inspect
import logging
import re
import textwrap
import weakref
from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.core.optimizer import LRSchedulerConfig
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_frozen import adapters, anatomy, arguments, capabilities, lightning_seam, loops, memory, preemption
from lightning_frozen.base import pretrained, qlora
from lightning_frozen.base.fingerprint import FingerprintCache, named_frozen, verify_checkpoint_base
from lightning_frozen.base.loaded import LoadedBase
from lightning_frozen.checkpoint import file, streamed_save, trainable_state
from lightning_frozen.checkpoint.file import PathLike
from lightning_frozen.format import layout
from lightning_frozen.generation import wrap_generate
from lightning_frozen.hf import peft_adapters, transformers_loading
from lightning_frozen.ledger import RunLedger, open_run
from lightning_frozen.optim import schedulers, trainable_groups, unfreezing
from lightning_frozen.optim.filtering import prepare_for_zero, same_kind_of_optimizer, to_cpu_adam, trainable_params
from lightning_frozen.spec import StrategySpec, spec_fields
from lightning_frozen.zero import accelerator, optimizers
from lightning_frozen.zero.config import inference_config
from lightning_frozen.zero.engine import Placement, destroy_engine, initialize_engine, release_engine
from lightning_frozen.zero.frozen_compute import KERNELS, FrozenCompute, exit_cleanly, frozen_compute_for
from lightning_frozen.zero.params import check_has_trainable
from lightning_frozen.zero.whole import still_sharded_notice

if TYPE_CHECKING:
    import deepspeed
    from lightning.pytorch.strategies import StrategyRegistry


class FrozenAwareDeepSpeedStrategy(lightning_seam.DeepSpeedHooks):
    """DeepSpeed ZeRO-3 for models whose larger part is frozen: frozen params (``requires_grad=False``, or only in
    groups whose learning rate stays 0) get no gradients, fp32 master copies or optimizer state, whatever optimizer
    ``configure_optimizers`` returns, and are 1/N shards in the compute dtype, in CPU memory by default. Checkpoints
    hold the trainable state only. Every argument of ``DeepSpeedStrategy`` keeps working; runs on CUDA and the CPU.

    Its positional parameters are ``DeepSpeedStrategy``'s, in its order, with its defaults but ``stage=3``
    (``FrozenAwareDeepSpeedStrategy(None, True, 3, "cpu")`` means accelerator, zero_optimization, stage,
    remote_device); this package's own follow them, keyword-only.

    Args:
        accelerator: the Lightning accelerator, normally from the Trainer's ``accelerator=``; DeepSpeed's matches it.
        zero_optimization: use ZeRO; it must stay on, frozen params are sharded by ZeRO stage 3.
        stage: ZeRO stage; 3 shards frozen params across ranks.
        remote_device: where ``configure_model`` creates every param (``"cpu"`` or ``"nvme"``); by default frozen
            shards are created in CPU memory when ``offload_frozen`` and trainable ones are moved to the accelerator
            when the engine is built (docs/memory.md).
        offload_optimizer: step the optimizer on the CPU (ZeRO-Offload); a torch ``Adam``/``AdamW`` becomes
            DeepSpeed's CPU Adam with the same hyper-parameters.
        pin_memory: pin offloaded tensors in page-locked memory (with the strategy's arguments: frozen shards too).
        config: a DeepSpeed config dict or JSON file (else the file ``PL_DEEPSPEED_CONFIG_PATH`` names); its ZeRO
            stage must be 3.
        parallel_devices: the devices of this node's processes; normally set by the Trainer from ``devices=``.
        cluster_environment: where ranks and addresses come from (torchrun, SLURM, ...); detected by the Trainer.
        precision_plugin: Lightning's precision plugin; normally set by the Trainer from ``precision=``.
        process_group_backend: the torch.distributed backend; ``nccl`` on CUDA and ``gloo`` on the CPU by default.
        timeout: how long collectives wait for the other ranks before failing.
        exclude_frozen_parameters: no effect (a checkpoint is always one adapter file without frozen weights).
        load_full_weights: no effect either. Every other argument of ``DeepSpeedStrategy`` builds the same config as
            there.
        offload_frozen: keep the frozen ZeRO-3 shards in CPU memory (trainable params are not offloaded
            unless ``offload_parameters=True``, which offloads every param, as DeepSpeed does).
        convert_lr_zero_groups: freeze params that sit only in groups whose learning rate is 0 for the whole run.
        frozen_base: the frozen base's path or hub id, stored in checkpoints; found from the module when not given.
        fingerprint: how checkpoints verify the frozen base: ``"checksum"`` (every value, position-weighted,
            no gather), ``"sha256"`` (full hash of every frozen tensor, gathered one at a time) or ``"none"``.
        frozen_dtype: how frozen ZeRO-3 shards are stored: None (the compute dtype), ``"int8"`` (block-wise absmax,
            1.016 B/weight), ``"nf4"`` (4-bit NormalFloat, 0.531 B/weight) or ``"bf16"``/``"fp16"`` (a cast, 2 B/weight,
            for fp32 compute); decoded to the compute dtype for the layer computed (``zero/frozen_compute.py``).
        return_freed_memory: on the CPU, glibc gives freed buffers of 1 MiB+ back to the OS
            (``zero/compute/host_memory.py``).
        preemption_grace: seconds from a SIGTERM for a rank to stop at the next step boundary, save and exit;
            then, or on a second signal, it exits at once (``lightning_frozen.preemption``).
        generation_memory: bytes ``generate()`` may gather whole once per call, else per layer (docs/loops.md);
            a number asks for that gathering, so a DeepSpeed that moved its names raises here instead of warning.
        uneven_batches: ranks whose dataloader runs out before the others': ``"join"`` runs the
            same steps on a stand-in batch that counts for nothing until every rank has run out, ``"raise"`` refuses
            with ``UnevenBatchesError`` (docs/loops.md).
        code_cache: where the frozen base, as stored, is kept for the next fit, resume or load of it to map instead of
            reading and encoding its folder: True (``$LIGHTNING_FROZEN_CODE_CACHE``, else ``codes`` in the package's
            cache home), a folder, or False (``base/code_cache.py``, docs/frozen-storage.md).
    """

    strategy_name = "frozen_deepspeed"

    def __init__(
        self,
        # Lightning's `DeepSpeedStrategy` arguments, in its order: a positional call means what it means there
        accelerator: Optional[Any] = None,
        zero_optimization: bool = True,
        stage: int = 3,
        remote_device: Optional[str] = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_params_device: str = "cpu",
        nvme_path: str = "/local_nvme",
        params_buffer_count: int = 5,
        params_buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        offload_optimizer_device: str = "cpu",
        optimizer_buffer_count: int = 4,
        block_size: int = 1048576,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        thread_count: int = 1,
        pin_memory: bool = False,
        sub_group_size: int = 1_000_000_000_000,
        contiguous_gradients: bool = True,
        overlap_comm: bool = True,
        allgather_partitions: bool = True,
        reduce_scatter: bool = True,
        allgather_bucket_size: int = 200_000_000,
        reduce_bucket_size: int = 200_000_000,
        zero_allow_untested_optimizer: bool = True,
        logging_batch_size_per_gpu: Union[str, int] = "auto",
        config: Optional[Union[PathLike, dict[str, Any]]] = None,
        logging_level: int = logging.WARN,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        loss_scale: float = 0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: int = 1,
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        contiguous_memory_optimization: bool = False,
        synchronize_checkpoint_boundary: bool = False,
        load_full_weights: bool = False,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        exclude_frozen_parameters: bool = False,
        *,
        offload_frozen: bool = True,
        convert_lr_zero_groups: bool = True,
        frozen_base: Optional[str] = None,
        fingerprint: Literal["checksum", "sha256", "none"] = "checksum",
        frozen_dtype: Optional[Literal["int8", "nf4", "bf16", "fp16"]] = None,
        return_freed_memory: bool = True,
        preemption_grace: float = preemption.DEFAULT_GRACE_SECONDS,
        generation_memory: Union[int, str] = "auto",
        uneven_batches: Literal["join", "raise"] = "join",
        code_cache: Union[bool, str, PathLike] = True,
    ) -> None:
        given = locals()
        flags = dict(zero_optimization=zero_optimization, offload_frozen=offload_frozen)
        flags.update(offload_optimizer=offload_optimizer, convert_lr_zero_groups=convert_lr_zero_groups)
        flags["return_freed_memory"] = return_freed_memory
        arguments.check_strategy_arguments(
            flags, frozen_base, timeout, config, fingerprint, zero_optimization, stage, frozen_dtype
        )
        super().__init__(**{name: given[name] for name in arguments.STOCK_ARGUMENTS if name in given})
        # resolved once: for ZeRO the config that runs decides, whether the arguments built it or `config=` gave it
        own = {name: flags[name] for name in ("offload_frozen", "convert_lr_zero_groups", "return_freed_memory")}
        own.update(frozen_dtype=frozen_dtype, fingerprint=fingerprint, frozen_base=frozen_base)
        own.update(generation_memory=generation_memory, preemption_grace=preemption_grace)
        own.update(uneven_batches=uneven_batches, code_cache=code_cache)
        config_source = arguments.config_source(config, self.DEEPSPEED_ENV_VAR)
        self._spec = arguments.resolve_spec(self.config, config_source, pin_memory, **own)
        capabilities.check_for_run(self._spec)  # a renamed hook would leave this strategy running as stock DeepSpeed
        self._preemption = preemption.Preemption(self._spec.preemption_grace)
        self._joining = loops.Joining(refuse=self._spec.uneven_batches == "raise")  # ranks that ran out of data
        self._anatomy: Optional[anatomy.Anatomy] = None  # the module's, found once per setup (`_module_anatomy`)
        self._optimized = trainable_groups.TrainableGroups()
        self._deferred = streamed_save.DeferredTensors()  # the trainable tensors of the save being built
        self._freezes: list[Callable[[Module], None]] = []  # this run's finetuning callbacks' `freeze_before_training`
        self._loaded_base = LoadedBase()  # what the sliced loader read: sums for the fingerprint, sources for setup
        self._fingerprints = FingerprintCache(self._loaded_base, KERNELS)
        self._connected: Optional[weakref.ref[Module]] = None  # the module of the last run
        self._ledger = RunLedger()  # what a run changes outside its own objects, undone at its teardown
        self._row_hooks = ExitStack()  # adapters.guard_rows' hooks on this run's LoRA layers (emptied at each build)
        self._drops_layers = False  # the module skips layers at random in training (LayerDrop): found at each fit
        self.run_from_command_line = False  # the `lightning-frozen` command sets it: its advice after a run differs

    @property
    def spec(self) -> StrategySpec:
        """The strategy's arguments and DeepSpeed config, resolved once (``lightning_frozen/spec.py``)."""
        return self._spec

    # the arguments users read back: views of the spec
    offload_frozen, offload_optimizer, pin_memory = spec_fields("offload_frozen", "offload_optimizer", "pin_memory")
    frozen_base, fingerprint, frozen_dtype = spec_fields("frozen_base", "fingerprint", "frozen_dtype")
    convert_lr_zero_groups, return_freed_memory = spec_fields("convert_lr_zero_groups", "return_freed_memory")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        arguments.register_names(strategy_registry, cls)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        # each run fingerprints the base again; another module must not meet this one's optimizer and param names
        self._fingerprints.clear()
        self._freezes, self._anatomy = [], None  # found again once this run's freezes ran
        if self._connected is None or self._connected() is not model:
            self.optimizers, self.lr_scheduler_configs = [], []
            self._optimized.forget_groups()
        self._connected = weakref.ref(model)
        super().connect(model)

    @property
    def param_group_names(self) -> list[list[str]]:
        """The names of the params in each param group of the ZeRO optimizer, in group order."""
        return self._optimized.group_names

    @property
    def _module(self) -> pl.LightningModule:
        assert self.lightning_module is not None
        return self.lightning_module

    @override
    def setup_environment(self) -> None:
        # this run's, with its own tables; PEFT's LoRA on a param read for it by the hf seam
        self._compute = compute = frozen_compute_for(self.root_device, peft_adapters.PARAM_LORA)
        if self.lightning_module is not None:  # as stock, the environment alone may be set up, with no model connected
            self._open_run(self.lightning_module, compute)
        self._ledger.enter(accelerator.deepspeed_accelerator_matching(self.accelerator), "DeepSpeed's accelerator")
        if self.return_freed_memory:  # on the CPU, gathers live in host memory
            self._ledger.callback(compute.set_process_memory() or (lambda: None), "the process's memory settings")
        # torch's OpenMP threads spin long while they wait: with other threads on the cores, a step many times slower
        self._ledger.callback(compute.watch_waits() or (lambda: None), "OpenMP's sleeping team")
        arguments.check_config_for_accelerator(self.config, self.accelerator)
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's refuses the CPU, whose DeepSpeed accelerator works

    def _open_run(self, module: pl.LightningModule, compute: FrozenCompute) -> None:
        """The run's part of the set-up: its ledger opened, preemption handled, ``module`` and its Trainer checked."""
        open_run(self._ledger, module, self._preemption, compute)
        # ours for every phase from here on, Lightning's never registered: a signal during the user's setup(), the load
        # or the dataloaders ends the run at the next of the strategy's boundaries (`Preemption.stop_before_training`)
        self._preemption.install(module.trainer, self.launcher)
        self._row_hooks = self._ledger.scope("the guarded adapter layers' hooks")
        file.require_restore_path(module.trainer, self.checkpoint_io)  # a wrong `ckpt_path` fails before the load
        unfreezing.check_finetuning_callbacks(module)
        qlora.check_not_quantized(module)  # bitsandbytes' layers, built in `__init__`

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):  # no device index: DeepSpeedStrategy's check does not apply
            reset_seed()
            self.set_world_ranks()
            if note := accelerator.shared_memory_op_build_note():  # DeepSpeed compiles it silently as its group starts
                rank_zero_info(note)
            self.start_deepspeed_distributed()
        else:
            super().setup_distributed()
        exit_cleanly()
        index = self.local_rank if self.root_device.index is None else self.root_device.index  # CPU: the local rank
        self._placement = Placement(self.root_device, index)

    def _module_anatomy(self) -> anatomy.Anatomy:
        """The module's anatomy: found once per setup, and again once what trains changed (a rebuild)."""
        if self._anatomy is None:
            self._anatomy = anatomy.anatomy_of(self._module, self.spec.frozen_base)
        return self._anatomy

    @override
    def build_optimizer(self) -> tuple[Optimizer, Optional[LRSchedulerConfig]]:
        module = self._module
        for freeze in self._freezes:  # finetuning callbacks' freezes, now that `configure_model` built the module
            freeze(module)
        optimizer, scheduler_config = super().build_optimizer()
        scheduler = scheduler_config.scheduler if scheduler_config is not None else None
        optimizer = prepare_for_zero(module, optimizer, scheduler, self.convert_lr_zero_groups, type(self).__name__)
        if self.spec.offload_optimizer:
            optimizer = to_cpu_adam(optimizer, scheduler)
        adapters.check_optimizer_groups(module, self._module_anatomy(), optimizer)
        self._optimized.record_groups(module, optimizer)
        return optimizer, scheduler_config

    @override
    def build_engine(
        self, model: Module, optimizer: Optional[Optimizer], lr_scheduler: Optional[Any] = None
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer]:
        check_has_trainable(model)
        self._optimized.record_flags(model, optimizer)
        trainable = trainable_params(model)
        where, loaded = self._placement, self._loaded_base
        reads = peft_adapters.params_read_outside_forward(model)
        built = initialize_engine(
            model, self.config, self.spec, where, self._compute, optimizer, lr_scheduler, trainable, loaded, reads
        )
        adapters.engine_built(built[1], self._module_anatomy(), self._optimized.trained_names(), self._row_hooks)
        return built

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs here: params are ZeRO-3 shards as they are created (frozen ones in CPU memory when
        offloaded), and ``from_pretrained`` loads each rank's slice of every tensor straight into its shard."""
        self.complete_config()
        remote_device = self.remote_device or ("cpu" if self.spec.offload_frozen else None)
        spec = self.spec
        plan = pretrained.LoadPlan(self._loaded_base, spec.frozen_dtype, spec.fingerprint, code_cache=spec.code_cache)
        with pretrained.sharded_model_creation(self.config, remote_device, plan):
            yield
        # the one fact a setup may add to the spec: the frozen_dtype a bitsandbytes `quantization_config` chose
        self._spec = self._spec.with_frozen_dtype(plan.frozen_dtype)
        self._preemption.stop_before_training()  # a signal in the load: the loader's patches are undone here

    @override
    def init_deepspeed(self) -> None:
        """The run's engine. ``fit``: Lightning's (its gradient-clipping checks, then ``build_optimizer`` and
        ``build_engine``), then the memory summary and the frozen base's fingerprint. ``validate``/``test``/``predict``:
        the same checks, then an engine without an optimizer over the frozen-aware config."""
        module, model = self._module, self.model
        assert isinstance(model, Module)
        if module.trainer and module.trainer.training:
            super().init_deepspeed()
            self._drops_layers = transformers_loading.drops_layers(model)
            if self.is_global_zero:
                rank_zero_info(self.memory_summary() + self._joining.summary(self.world_size))
            self.frozen_base_fingerprint()  # one pass over the frozen shards now: saving costs only the trainable state
            return
        check_gradient_clipping(module)
        for freeze in self._freezes:
            freeze(module)
        assert isinstance(self.config, dict)
        remove_module_hooks(model)
        config, loaded = inference_config(self.config), self._loaded_base
        reads = peft_adapters.params_read_outside_forward(model)
        self.model, _ = initialize_engine(
            model, config, self.spec, self._placement, self._compute, loaded=loaded, read_outside_forward=reads
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._compute.step_starts()  # e.g. brief OpenMP waits while other threads took the cores since the last step
        self._optimized.check_unchanged()
        # LayerDrop runs every layer on every rank only where transformers believes ZeRO-3 is on: for the step alone;
        # a stand-in's step where this rank ran out of data
        layers = transformers_loading.zero3_known(self.config) if self._drops_layers else nullcontext()
        with layers, self._joining.step("train", self._module):
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Any:
        # where ranks ran out of data: a stand-in's loss weighs 0, the others' average over the real batches
        return super().backward(self._joining.weighed(closure_loss), optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._compute.step_starts()
        with self._joining.step("val", self._module):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._compute.step_starts()
        with self._joining.step("test", self._module):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._compute.step_starts()
        with self._joining.step("predict", self._module) as share:
            predicted = super().predict_step(*args, **kwargs)
        return None if share is not None and share.joined else predicted  # a stand-in's predicts nothing

    @override
    def on_train_start(self) -> None:
        loops.start_next_epoch_afresh(self._module.trainer.fit_loop)  # a resumed run counts epochs as one never stopped
        self._preemption.stop_before_training()  # before the first batch: a signal in sanity or `train_dataloader()`
        self._preemption.training = True  # from now on a signal stops at the next step boundary
        wrap_generate(self._ledger, self)  # `generate` gathers the base once per call where it fits

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return loops.even_dataloader(dataloader, self._module.trainer, self.world_size, self._joining)

    @override
    def on_validation_start(self) -> None:
        wrap_generate(self._ledger, self)  # `generate` gathers the base once per call where it fits

    on_test_start = on_predict_start = on_validation_start

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._preemption.end_run(exception)

    @override
    def teardown(self) -> None:
        """After a run, returned or raised: its engine released (``zero/engine.release_engine``), its changes undone,
        even where the release raises (that error then goes on to the caller)."""
        module = self.lightning_module
        try:
            if module is not None:
                release_engine(self.model, module)
                callback = module.trainer.checkpoint_callback
                saved = getattr(callback, "best_model_path", None) or getattr(callback, "last_model_path", None)
                notice = still_sharded_notice(module, self.run_from_command_line, saved)
                # RUNNING: the run returned (Lightning marks a raised one INTERRUPTED before its teardown)
                if notice and module.trainer.state.status == TrainerStatus.RUNNING:
                    rank_zero_info(notice)
        finally:
            self._ledger.close()  # the module outlives the run: outside it, it and the process are the user's own
            self._anatomy = None  # it holds the PEFT model: the next run, or a save after this one, finds it again
            super().teardown()

    def freeze_once_built(self, freeze: Callable[[Module], None]) -> None:
        """Run ``freeze(module)`` in this run once ``configure_model`` built the module (a finetuning callback's)."""
        self._freezes.append(freeze)

    def finetune(self, finetune: Callable[[unfreezing.StagedOptimizer], None]) -> None:
        """Apply what ``finetune`` (a callback's) does to a stand-in optimizer: new hyper-parameters, or a rebuild.

        Raises:
            DependencyDriftError: a name progressive unfreezing needs moved.
        """
        capabilities.require(capabilities.UNFREEZING)
        if regrouped := unfreezing.stage(self._module, self._deepspeed_optimizer, self.param_group_names, finetune):
            self.reconfigure_trainable(regrouped)

    def reconfigure_trainable(self, param_groups: list[dict[str, Any]]) -> None:
        """Rebuild the ZeRO optimizer over ``param_groups`` (the current ones in order, then any added) once params
        were unfrozen or frozen mid-run, carrying state. Collective.

        Raises:
            DependencyDriftError: a name progressive unfreezing needs moved.
        """
        capabilities.require(capabilities.UNFREEZING)
        module, num_groups = self._module, len(self._optimized.group_names)
        change = unfreezing.plan_change(module, param_groups, self._optimized.trained_names())
        carried = unfreezing.carry_state(self.deepspeed_engine, module, change.keep)
        optimizer = same_kind_of_optimizer(optimizers.inner_optimizer(self._deepspeed_optimizer), change.groups)
        destroy_engine(self.deepspeed_engine, module, change.refrozen, self.spec.offload_frozen)
        self._optimized.group_names, self._anatomy = change.group_names, None  # what trains changed
        self.model, deepspeed_optimizer = self.build_engine(module, optimizer)
        self.optimizers = [deepspeed_optimizer]
        for config in self.lr_scheduler_configs:  # DeepSpeed runs one optimizer, so one scheduler at most
            optimizers.point_schedulers_at(config.scheduler, optimizer)
            schedulers.follow_added_groups(config.scheduler, optimizer, num_groups)
        rank_zero_info(change.summary(unfreezing.restore_state(self.model, module, carried)))

    @property
    def _deepspeed_optimizer(self) -> Any:
        return self.optimizers[0] if self.optimizers else None

    def frozen_base_fingerprint(
        self, named: Optional[list[tuple[str, Any]]] = None, mode: Optional[str] = None
    ) -> dict[str, Any]:
        """The fingerprint of the module's frozen params (default: all, in this strategy's mode); collective, cached."""
        named = named_frozen(self._module, copies=self._module_anatomy().trained_copies) if named is None else named
        return self._fingerprints(named, mode or self.spec.fingerprint)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable params and persistent buffers, never a frozen weight: each trainable param a placeholder on
        the meta device, filled as :meth:`save_checkpoint` writes the file (``checkpoint/streamed_save.py``)."""
        self._deferred, ungrouped = streamed_save.DeferredTensors(), self._optimized.ungrouped_names
        return trainable_state.trainable_state_dict(self._module, self._deepspeed_optimizer, self._deferred, ungrouped)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by param name (any world size resumes it), per-element states as placeholders."""
        names = self._optimized.group_names
        return trainable_state.optimizer_state_by_name(optimizer, self._module, names, self._deferred)

    @override
    def save_checkpoint(self, checkpoint_dict: dict, filepath: PathLike, storage_options: Optional[Any] = None) -> None:
        """Write one file with the trainable state and the frozen base's reference and fingerprint, from rank 0,
        atomically (a local path, an fsspec URL, or the Trainer's ``CheckpointIO`` plugin), each trainable tensor
        gathered to rank 0 alone as it is written. Collective."""
        checkpoint_io = file.user_checkpoint_io(self.checkpoint_io, storage_options)
        filepath = self.broadcast(filepath)
        written_with = {layout.WORLD_SIZE: self.world_size, layout.PRECISION: str(self.precision_plugin.precision)}
        record, found = self.frozen_base_fingerprint(), self._module_anatomy()
        full = trainable_state.saved_checkpoint(checkpoint_dict, self._module, found, record, **written_with)
        streamed_save.write(full, filepath, self._deferred, self.is_global_zero, checkpoint_io, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a lightning-frozen file on every rank and verify the frozen base against it (collective)."""
        checkpoint_path = self.broadcast(checkpoint_path)
        loaded = file.load(checkpoint_path, file.user_checkpoint_io(self.checkpoint_io))
        trainable_state.warn_if_stored_otherwise(loaded, self.spec.frozen_dtype, checkpoint_path)
        if self.spec.fingerprint != "none":
            copies = self._module_anatomy().trained_copies
            verify_checkpoint_base(loaded, self._module, str(checkpoint_path), self._fingerprints, copies)
        return loaded

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        module = self._module
        if module.trainer.training and self._deepspeed_optimizer:
            # what was trainable when the checkpoint was saved trains again, in its groups (a finetuning callback)
            regrouped = unfreezing.groups_from_checkpoint(module, checkpoint_dict)
            if regrouped is not None:
                self.reconfigure_trainable(regrouped)
        state_dict, ungrouped = layout.state_dict_of(checkpoint_dict), self._optimized.ungrouped_names
        trainable_state.load_trainable_state(module, state_dict, self._deepspeed_optimizer, ungrouped, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint_dict: Mapping[str, Any]) -> None:
        saved = checkpoint_dict[layout.OPTIMIZER_STATES][0]
        trainable_state.load_optimizer_state_by_name(self._deepspeed_optimizer, self._module, saved)

    def memory_summary(self) -> str:
        """The per-rank memory summary logged on rank 0 at the start of ``fit``."""
        module, optimizer, precision = self._module, self._deepspeed_optimizer, str(self.precision_plugin.precision)
        loaded, ranks = self._loaded_base, self.num_processes
        return memory.run_summary(module, optimizer, self.spec, loaded, precision, self.world_size, ranks)


def _init_doc(strategy: type) -> str:
    """The docstring of ``strategy.__init__``, read by ``help()`` and by the CLI's help (jsonargparse reads it and the
    class's): what the strategy is, its own arguments, then Lightning's description of each ``DeepSpeedStrategy``
    argument that the class's docstring does not describe (not its introduction, which does not hold here)."""
    parameters = inspect.signature(strategy.__init__).parameters.values()
    own = ", ".join(f"``{p.name}``" for p in parameters if p.kind == p.KEYWORD_ONLY)
    described = strategy.__doc__ or ""
    stock = (DeepSpeedStrategy.__init__.__doc__ or "").partition("Arguments:")[2]
    entries = [textwrap.dedent(block).strip("\n") for block in re.split(r"\n[ \t]*\n", stock) if block.strip()]
    kept = [
        entry
        for entry in entries
        if not re.search(rf"^ *(\w+, )*{re.escape(entry.partition(':')[0])}\b", described, re.MULTILINE)
    ]
    about = (
        "Lightning's ``DeepSpeedStrategy`` at ZeRO stage 3 for a model whose larger part is frozen: frozen params get"
        " no gradients, fp32 master copies or optimizer state and are stored as 1/N shards (in CPU memory by default),"
        " and checkpoints hold the trainable state only (the class's docstring says more).",
        f"Its own arguments follow Lightning's, keyword-only: {own}.",
        "Lightning's ``DeepSpeedStrategy`` arguments keep working as there, with Lightning's defaults but ``stage=3``;"
        " ``exclude_frozen_parameters`` and ``load_full_weights`` have no effect (a checkpoint never holds a frozen"
        " weight).",
    )
    paragraphs = [textwrap.fill(text, 116) for text in about]
    return "\n\n".join([*paragraphs, "\n".join(["Args:", *(textwrap.indent(entry, "    ") for entry in kept)])])


FrozenAwareDeepSpeedStrategy.__init__.__doc__ = _init_doc(FrozenAwareDeepSpeedStrategy)


def check_gradient_clipping(module: pl.LightningModule) -> None:
    """Lightning's checks of gradient clipping under DeepSpeed, made as its ``init_deepspeed`` makes them for any
    engine: a warning where ``module`` overrides ``configure_gradient_clipping``, which DeepSpeed does not call.

    Raises:
        MisconfigurationException: the Trainer clips by value, which DeepSpeed does not.
    """
    if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
        rank_zero_warn(
            "Since DeepSpeed handles gradient clipping internally, the default"
            " `LightningModule.configure_gradient_clipping` implementation will not actually clip gradients."
            " The hook will still be called. Consider setting"
            " `Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm')`"
            " which will use the internal mechanism."
        )
    if module.trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise MisconfigurationException("DeepSpeed does not support clipping gradients by value.")
