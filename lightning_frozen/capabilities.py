"""The one table of other packages' private names the package relies on, by what needs them: the core, or one optional
capability (:class:`~lightning_frozen.foreign_names.Capability`: its names, what it changes in a run, what a run does
without it).

A strategy checks the core's names and those of the capabilities its arguments ask for when it is built
(:func:`check_for_run`): a moved one raises :class:`~lightning_frozen.errors.DependencyDriftError`. Every other
capability is looked up where it is first used: its code asks :func:`available` before it changes anything, which,
where a name moved, turns it off with one warning per process that names it and what the run does instead, and takes
the fallback; an entry point or a capability that cannot run without its names calls :func:`require` there, which
raises. A run so imports nothing of transformers or PEFT for a capability it does not use.
"""

from __future__ import annotations

import functools
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_frozen.errors import DependencyDriftError
from lightning_frozen.foreign_names import (
    Capability,
    ForeignName,
    drift_message,
    installed_version,
    off_warning,
    problem_of,
)
from lightning_frozen.spec import StrategySpec

_STRATEGY = "lightning.pytorch.strategies.deepspeed:DeepSpeedStrategy"
_SIGNALS = "lightning.pytorch.trainer.connectors.signal_connector"
_TRAINER = "lightning.pytorch.trainer.trainer:Trainer"
_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_PARTITION = "deepspeed.runtime.zero.partition_parameters"
_INIT = f"{_PARTITION}:Init"
_OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
_COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator"
_MODELING = "transformers.modeling_utils"
_LOADING = "hf/transformers_loading.py"
_CONVERSIONS = "hf/conversions.py"

CORE = Capability(
    "the core",
    fallback="",
    rows=(
        # Lightning's hooks the strategy overrides (renamed, it would quietly run as stock DeepSpeed), and helpers
        ForeignName(f"{_STRATEGY}._init_optimizers", "lightning_seam.py", ("self",), exact=True),
        ForeignName(
            f"{_STRATEGY}._setup_model_and_optimizer",
            "lightning_seam.py",
            ("self", "model", "optimizer", "lr_scheduler"),
            exact=True,
        ),
        ForeignName(f"{_STRATEGY}._init_deepspeed_distributed", "lightning_seam.py", ("self",)),
        ForeignName(f"{_STRATEGY}._init_config_if_needed", "lightning_seam.py", ("self",)),
        # the ZeRO-3 optimizer's inner state by param, and a sub-group's step that makes it
        ForeignName(
            f"{_STAGE3}.__init__",
            "zero/params.py, zero/engine.py",
            in_code=("grad_position", "fp32_partitioned_groups_flat", "optimizer", "parameter_offload"),
        ),
        ForeignName(f"{_STAGE3}.get_param_id", "zero/params.py", ("self", "param")),
        ForeignName(f"{_STAGE3}._optimizer_step", "zero/params.py", ("self", "sub_group_id")),
        # a ZeRO-3 param's attributes; zero.Init's bookkeeping, put back where a module is built outside it
        ForeignName(
            f"{_INIT}._convert_to_deepspeed_param",
            "zero/params.py, zero/frozen_storage.py, zero/compute/quantized.py, zero/placeholders.py",
            ("self", "param"),
            in_code=(
                "ds_id",
                "ds_numel",
                "ds_persist",
                "ds_process_group",
                "ds_shape",
                "ds_status",
                "ds_summary",
                "ds_tensor",
                "ds_quant_scale",
                "all_gather",
                "all_gather_coalesced",
                "partition",
            ),
        ),
        ForeignName(
            f"{_PARTITION}:InsertPostInitMethodToModuleSubClasses.patch_init_and_builtins",
            "zero/init.py",
            in_code=("_old_init", "_old_init_subclass", "_old_apply", "_old_apply_of_skip_init_hook", "__old_new__"),
        ),
        ForeignName(f"{_PARTITION}:top_level_context", "zero/init.py"),
        ForeignName(f"{_OFFLOAD}:DeepSpeedZeRoOffload.__init__", "zero/forward_trace.py", in_code=("forward_hooks",)),
        # CPU Adam
        ForeignName("deepspeed.ops.adam:DeepSpeedCPUAdam.__init__", "zero/optimizers.py", in_code=("adam_w_mode",)),
        ForeignName(
            "torch.nn.modules.module:Module.__init__",
            "zero/engine.py, zero/whole.py, zero/forward_trace.py, zero/compute/coded_linear.py",
            in_code=("_parameters", "_forward_pre_hooks"),
        ),
        ForeignName("torch:Tensor._version", "zero/params.py"),
    ),
)

RESUMED_EPOCH = Capability(
    "the resumed epoch counted as in a run never stopped",
    fallback="a fit resumed from a checkpoint saved at an epoch's last batch counts the next epoch as Lightning does"
    " (its `on_train_epoch_start` skipped, its shuffle seeded with the previous epoch's number)",
    changes="the fit loop's restart stage cleared at the start of a resumed fit (loops.start_next_epoch_afresh)",
    rows=(
        ForeignName("lightning.pytorch.loops.fit_loop:_FitLoop.restarted_mid_epoch", "loops.py"),
        # called as Lightning calls it, on no arguments: one more is another contract
        ForeignName("lightning.pytorch.loops.fit_loop:_FitLoop.reset_restart_stage", "loops.py", ("self",), exact=True),
    ),
)

SCALER_RESUME = Capability(
    "the fp16 loss scale continued by a resume",
    fallback="a checkpoint does not keep DeepSpeed's dynamic fp16 loss scale, and a resumed `16-mixed` run's scale"
    " starts afresh",
    rows=(
        ForeignName(f"{_STAGE3}.__init__", "zero/params.py", in_code=("loss_scaler",)),
        ForeignName(
            "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler.update_scale",
            "zero/params.py",
            in_code=("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"),
        ),
    ),
)

SCHEDULER_INTERNALS = Capability(
    "learning-rate schedulers read inside",
    fallback="a mid-run rebuild points only the outermost scheduler at the rebuilt optimizer (not those inside"
    " `SequentialLR` / `ChainedScheduler`), and a group at learning rate 0 under a scheduler stays in the optimizer"
    " (the `lr=0` workaround's cost)",
    rows=(
        ForeignName(
            "deepspeed.runtime.lr_schedules:WarmupCosineLR.__init__", "optim/filtering.py", in_code=("org_lrs",)
        ),
        ForeignName("torch.optim.lr_scheduler:SequentialLR.__init__", "zero/optimizers.py", in_code=("_schedulers",)),
        ForeignName(
            "torch.optim.lr_scheduler:ChainedScheduler.__init__", "zero/optimizers.py", in_code=("_schedulers",)
        ),
    ),
)

PEFT_LAYERS = Capability(
    "PEFT's layer internals (adapters created whole in `configure_model`, each adapter's params)",
    fallback="adapters PEFT creates in `configure_model` are built as ZeRO-3 shards, so PEFT's own initialisation of"
    " them is lost (build the PEFT model in `__init__`), and a checkpoint names no adapter's params apart",
    changes="`PeftModel.__init__` and `BaseTuner.inject_adapter`, wrapped class-wide while `configure_model` runs"
    " (hf/peft_adapters.around_adapter_creation)",
    rows=(
        ForeignName(
            "peft.peft_model:PeftModel.__init__",
            "hf/peft_adapters.py",
            ("self", "model", "peft_config", "adapter_name"),
        ),
        ForeignName(
            "peft.tuners.tuners_utils:BaseTuner.inject_adapter",
            "hf/peft_adapters.py",
            ("self", "model", "adapter_name"),
        ),
        ForeignName("peft.tuners.tuners_utils:BaseTunerLayer.adapter_layer_names", "hf/peft_adapters.py"),
    ),
)

PREEMPTION = Capability(
    "preemption (a stop signal saved at the next step boundary)",
    fallback="Lightning's own signal handling: its SIGTERM handler, which broadcasts inside the handler (against a"
    " ZeRO-3 all-gather on another rank that can hang), and its SLURM requeue",
    changes="the run's SIGTERM and requeue handlers and a watchdog thread, in place of Lightning's signal connector"
    " (preemption.Preemption.install)",
    rows=(
        ForeignName(f"{_SIGNALS}:_SignalConnector._slurm_sigusr_handler_fn", "preemption.py", ("self", "signum", "_")),
        ForeignName(f"{_TRAINER}.__init__", "preemption.py", in_code=("_signal_connector",)),
        ForeignName(f"{_SIGNALS}:_SignalConnector.register_signal_handlers", "preemption.py", ("self",)),
    ),
)


ZERO3_SWITCH = Capability(
    "transformers told that ZeRO-3 is on, and told back after",
    fallback="the switch is set with transformers' public `HfDeepSpeedConfig` and unset after, so an"
    " `HfDeepSpeedConfig` a user made before the run no longer holds after `configure_model`",
    changes="transformers' ZeRO-3 belief, around `configure_model` (hf/transformers_loading.zero3_known)",
    rows=(ForeignName("transformers.integrations.deepspeed:_hf_deepspeed_config_weak_ref", _LOADING),),
)

CPU_COMPUTE = Capability(
    "CPU frozen compute",
    fallback="frozen shards are decoded whole where they are gathered, as on an accelerator (slower steps)",
    changes="glibc's mmap threshold and layers computed from their codes (zero/frozen_compute.CpuFrozenCompute)",
    rows=(
        ForeignName("torch._C:_storage_Use_Count", "zero/compute/host_memory.py"),
        ForeignName("torch:UntypedStorage._cdata", "zero/compute/host_memory.py"),
    ),
)

ROUTED_EXPERTS = Capability(
    "a MoE layer's routed experts computed from their codes on the CPU",
    fallback="a MoE layer's fused experts are decoded whole at each gather (slower steps, a layer's decoded experts"
    " held while it computes)",
    changes="the forward of each fused-experts module and of the PEFT ParamWrappers around it, on the instance, until"
    " the run ends (zero/compute/coded_experts.py)",
    rows=(
        ForeignName(
            "transformers.integrations.moe:use_experts_implementation",
            "zero/compute/coded_experts.py",
            in_code=("is_concatenated", "is_transposed", "has_bias", "has_gate", "has_post_expert_norm", "_apply_gate"),
        ),
    ),
)

# transformers' converter of a folder's tensors, run as its loader runs it (hf/conversions.py)
_CONVERTER_ROWS = (
    ForeignName("transformers.core_model_loading:dot_natural_key", _CONVERSIONS, ("s",)),
    ForeignName(
        "transformers.core_model_loading:WeightTransform.add_tensor",
        _CONVERSIONS,
        ("self", "target_key", "source_key", "source_pattern", "future"),
    ),
    ForeignName(
        "transformers.core_model_loading:WeightConverter.convert",
        _CONVERSIONS,
        ("self", "layer_name", "model", "config"),
    ),
)

SLICED_LOADING = Capability(
    "sliced loading from hub folders",
    fallback="`from_pretrained` under ZeRO-3 loads as transformers does (each rank reads every tensor whole, a slower"
    " load), and a bitsandbytes `quantization_config` is not taken over as `frozen_dtype`",
    changes="transformers' loading steps and `zero.Init`'s partitioning, while `configure_model` runs"
    " (base/pretrained.zero3_pretrained_loading)",
    rows=(
        ForeignName(
            f"{_MODELING}:load_state_dict",
            _LOADING,
            ("checkpoint_file", "map_location", "weights_only", "disable_mmap"),
            exact=True,
        ),
        ForeignName(
            f"{_MODELING}:_load_state_dict_into_zero3_model",
            _LOADING,
            ("model_to_load", "state_dict", "load_config"),
            exact=True,
        ),
        ForeignName(
            f"{_MODELING}:PreTrainedModel.get_init_context",
            _LOADING,
            ("dtype", "is_quantized", "_is_ds_init_called", "allow_all_kernels"),
        ),
        ForeignName(
            f"{_MODELING}:get_hf_quantizer",
            _LOADING,
            ("config", "quantization_config", "device_map", "weights_only", "user_agent", "gguf_file"),
            exact=True,
        ),
        ForeignName(f"{_MODELING}:safe_open", _LOADING),
        ForeignName(f"{_MODELING}:_is_ds_init_called", _LOADING),
        ForeignName("transformers.initialization:uniform_", _LOADING, in_code=("_is_hf_initialized",)),
        ForeignName(
            "transformers.core_model_loading:rename_source_key",
            _CONVERSIONS,
            ("source_key", "weight_renamings", "weight_converters", "base_model_prefix", "meta_state_dict"),
        ),
        ForeignName(
            "transformers.utils.quantization_config:BitsAndBytesConfig.__init__",
            _LOADING,
            in_code=(
                "bnb_4bit_quant_type",
                "bnb_4bit_use_double_quant",
                "bnb_4bit_compute_dtype",
                "llm_int8_skip_modules",
                "llm_int8_has_fp16_weight",
            ),
        ),
        ForeignName(
            "peft.utils.other:prepare_model_for_kbit_training",
            _LOADING,
            in_code=("is_loaded_in_4bit", "is_loaded_in_8bit"),
        ),
        ForeignName(
            f"{_INIT}.__init__",
            "zero/placeholders.py",
            in_code=("remote_device", "pin_memory", "quantized_nontrainable_weights"),
        ),
        ForeignName(
            f"{_INIT}._partition_param",
            "zero/placeholders.py",
            ("self", "param", "buffer", "has_been_updated", "free_data"),
            exact=True,
            in_code=("ds_numel_aligned",),
        ),
        ForeignName(f"{_INIT}._zero_init_param", "zero/placeholders.py", ("self", "param"), exact=True),
    ),
)

GENERATE = Capability(
    "gather-once `generate`",
    fallback="`generate()` gathers the frozen base layer by layer, once per new token, as ZeRO-3 does by itself",
    changes="each transformers model's `generate`, wrapped for the run (generation.wrap_generate)",
    asked=lambda spec: spec.generation_memory is not None,
    rows=(
        ForeignName(f"{_OFFLOAD}:DeepSpeedZeRoOffload.get_param_coordinator", "zero/gather_once.py", ("self",)),
        ForeignName(f"{_COORDINATOR}.release_and_reset_all", "zero/gather_once.py", ("self", "module")),
        ForeignName(
            f"{_OFFLOAD}:DeepSpeedZeRoOffload._register_deepspeed_module",
            "zero/gather_once.py",
            in_code=("pre_sub_module_forward_function", "post_sub_module_forward_function", "FWD_MODULE_STACK"),
        ),
        ForeignName(
            f"{_OFFLOAD}:DeepSpeedZeRoOffload.pre_sub_module_forward_function",
            "zero/gather_once.py",
            ("self", "sub_module"),
            exact=True,
            in_code=("FWD_MODULE_STACK",),
        ),
        ForeignName(
            f"{_OFFLOAD}:DeepSpeedZeRoOffload.post_sub_module_forward_function",
            "zero/gather_once.py",
            ("self", "sub_module"),
            exact=True,
        ),
    ),
)

SEVERAL_ADAPTERS = Capability(
    "several adapters trained at once (per-adapter clipping, a batch's rows by adapter)",
    fallback="a run that trains two or more adapters at once raises DependencyDriftError when its engine is built",
    changes="the ZeRO-3 optimizer's norm and clip methods, on the instance (zero/adapter_clipping.py), and forward"
    " hooks on the LoRA layers (adapters.guard_rows)",
    rows=(
        ForeignName(f"{_STAGE3}.__init__", "zero/adapter_clipping.py", in_code=("sub_group_to_group_id", "clip_grad")),
        ForeignName(f"{_STAGE3}._get_norm_groups", "zero/adapter_clipping.py", ("self",), exact=True),
        ForeignName(
            f"{_STAGE3}.unscale_and_clip_grads",
            "zero/adapter_clipping.py",
            ("self", "sub_group_id", "total_norm"),
            exact=True,
        ),
        ForeignName(
            "peft.tuners.lora.layer:LoraLayer.__init__",
            "hf/peft_adapters.py",
            in_code=("base_layer", "lora_A", "lora_B", "lora_dropout", "scaling", "lora_embedding_A", "lora_variant"),
        ),
        # where a checkpointed layer's forward calls the function, which `gradient_checkpointing_enable` sets
        ForeignName(
            "transformers.modeling_layers:GradientCheckpointingLayer.__init_subclass__",
            "hf/checkpointing.py",
            in_code=("_gradient_checkpointing_func",),
        ),
    ),
)

UNFREEZING = Capability(
    "progressive unfreezing",
    fallback="a finetuning callback that changes what trains raises DependencyDriftError when it does",
    changes="the ZeRO optimizer rebuilt mid-run (strategy.reconfigure_trainable)",
    rows=(
        ForeignName(
            "lightning.pytorch.callbacks.finetuning:BaseFinetuning._store",
            "finetuning.py",
            ("self", "pl_module", "opt_idx", "num_param_groups", "current_param_groups"),
        ),
        ForeignName(
            "deepspeed.runtime.engine:DeepSpeedEngine.__init__",
            "zero/optimizers.py",
            in_code=("global_steps", "global_samples", "micro_steps", "skipped_steps"),
        ),
    ),
)

CONVERT = Capability(
    "`convert` (a stock DeepSpeed checkpoint directory read)",
    fallback="`convert_deepspeed_checkpoint` raises DependencyDriftError",
    rows=(
        ForeignName(
            "deepspeed.utils.zero_to_fp32:_zero3_merge_trainable_params",
            "zero/checkpoint_files.py",
            ("state_dict", "world_size", "fp32_flat_groups", "zero_model_states"),
        ),
    ),
)

CONVERTED_LOADING = Capability(
    "sliced loading of folders whose tensors transformers converts at load (MoE experts fused into one per layer)",
    fallback="such a folder loads through transformers' own ZeRO-3 loader: rank 0 reads each tensor and broadcasts it,"
    " and a `frozen_dtype` stores the base only at setup",
    rows=(
        *_CONVERTER_ROWS,
        ForeignName(
            "transformers.core_model_loading:revert_weight_conversion",
            _CONVERSIONS,
            ("model", "state_dict"),
            in_code=("_weight_conversions",),
        ),
    ),
)

MERGE_CHECK = Capability(
    "PEFT's own refusal to merge, asked by `export_merged`",
    fallback="an adapter PEFT refuses to merge (a GPTQ base, replicated layers) fails in PEFT's own layer merge",
    rows=(ForeignName("peft.tuners.tuners_utils:BaseTuner._check_merge_allowed", "hf/merging.py", ("self",)),),
)

CONVERTED_EXPORT = Capability(
    "`export_merged` of a base transformers converts at load (MoE experts fused, legacy keys renamed)",
    fallback="`export_merged` raises DependencyDriftError for such a base; other bases merge as before",
    rows=(
        ForeignName(
            "transformers.core_model_loading:revert_weight_conversion",
            "hf/merging.py",
            ("model", "state_dict"),
            in_code=("_weight_conversions",),
        ),
        *_CONVERTER_ROWS,
    ),
)

RELEASE = Capability(
    "releasing a finished run's engine",
    fallback="a finished run's modules stay referenced by DeepSpeed until the process ends (their memory with them)",
    changes="DeepSpeed's module-level lists and caches cleared at teardown (zero/engine.release_engine)",
    rows=(
        ForeignName(
            "deepspeed.runtime.engine:DeepSpeedEngine.__init__",
            "zero/engine.py",
            in_code=("module_forward_pre_hook", "module_forward_post_hook"),
        ),
        ForeignName(f"{_OFFLOAD}:FWD_MODULE_STACK", "zero/engine.py"),
        ForeignName(f"{_OFFLOAD}:ZeROOrderedDict.__init__", "zero/engine.py", in_code=("_in_forward",)),
        ForeignName(f"{_COORDINATOR}._PartitionedParameterCoordinator__params_to_release", "zero/engine.py"),
    ),
)

TRACE = Capability(
    "keeping ZeRO-3's trace across a step's own forwards",
    fallback="a step that calls `self(...)` resets ZeRO-3's trace and nothing is prefetched (slower steps), and small"
    " frozen params stay whole on every rank after their first use",
    changes="the param offload's start-of-forward hook, replaced on the engine's module (zero/forward_trace.py)",
    rows=(
        ForeignName(
            f"{_OFFLOAD}:DeepSpeedZeRoOffload.setup_zero_stage3_hooks",
            "zero/forward_trace.py",
            in_code=("fwd_pre_hook",),
        ),
        ForeignName(f"{_OFFLOAD}:DeepSpeedZeRoOffload.__init__", "zero/engine.py", in_code=("persistent_parameters",)),
    ),
)

HOOKS_WHERE_PARAMS = Capability(
    "ZeRO-3's module hooks only on modules that hold params",
    fallback="ZeRO-3's hooks also run around every module that holds no param, fetching and releasing nothing (a"
    " slower step: 0.1-0.3 s at 1.1B on a 2-core CPU)",
    changes="DeepSpeed's hooks taken off the engine's modules that hold no param, light ones on those with params under"
    " them, which give DeepSpeed's back to one that reads a child's weight (zero/engine.hook_only_param_holders)",
    rows=(
        ForeignName(
            f"{_OFFLOAD}:DeepSpeedZeRoOffload._register_deepspeed_module",
            "zero/engine.py",
            in_code=("forward_hooks", "backward_hooks", "z3_leaf_module"),
        ),
        ForeignName(f"{_COORDINATOR.split(':')[0]}:iter_params", "zero/engine.py", ("module", "recurse")),
        # a weight read in a forward is registered on the module last on this stack
        ForeignName(f"{_OFFLOAD}:ZeROOrderedDict.__getitem__", "zero/engine.py", in_code=("FWD_MODULE_STACK",)),
        ForeignName(f"{_OFFLOAD}:FWD_MODULE_STACK", "zero/engine.py"),
        ForeignName(
            f"{_OFFLOAD}:DeepSpeedZeRoOffload.post_sub_module_backward_function",
            "zero/engine.py",
            ("self", "sub_module"),
        ),
        ForeignName(f"{_PARTITION}:unregister_external_parameter", "zero/engine.py", ("module", "parameter")),
        ForeignName(
            "torch.nn.modules.module:Module.__init__",
            "zero/engine.py",
            in_code=("_forward_pre_hooks", "_forward_hooks"),
        ),
        ForeignName("torch.utils.hooks:RemovableHandle.__init__", "zero/engine.py", in_code=("hooks_dict_ref",)),
    ),
)

EARLY_CKPT_CHECK = Capability(
    "refusing a wrong `ckpt_path` before the model is built",
    fallback="a `ckpt_path` that names no checkpoint is refused only once the model is built and DeepSpeed started",
    rows=(ForeignName(f"{_TRAINER}._run", "lightning_seam.py's resolved_ckpt_path", ("self", "model", "ckpt_path")),),
)

OPTIONAL = (
    PREEMPTION,
    RESUMED_EPOCH,
    SCALER_RESUME,
    SCHEDULER_INTERNALS,
    PEFT_LAYERS,
    ZERO3_SWITCH,
    CPU_COMPUTE,
    ROUTED_EXPERTS,
    SLICED_LOADING,
    CONVERTED_LOADING,
    GENERATE,
    SEVERAL_ADAPTERS,
    UNFREEZING,
    CONVERT,
    MERGE_CHECK,
    CONVERTED_EXPORT,
    RELEASE,
    TRACE,
    HOOKS_WHERE_PARAMS,
    EARLY_CKPT_CHECK,
)
ROWS = tuple(row for capability in (CORE, *OPTIONAL) for row in capability.rows)


@functools.cache
def moved_names(capability: Capability) -> tuple[tuple[ForeignName, str], ...]:
    """The names of ``capability`` that moved in the installed packages, each with what is wrong; looked up once per
    process. A package that is not installed is skipped: its seam does nothing without it."""
    with warnings.catch_warnings():  # PEFT imports accelerate, whose import adds a filter: the process's stay as found
        found = ((row, problem_of(row)) for row in capability.rows if installed_version(row.package))
        return tuple((row, problem) for row, problem in found if problem is not None)


def available(capability: Capability) -> bool:
    """Whether every name ``capability`` needs is in the installed packages as it was written for; looked up where the
    capability is first used, once per process. Where one moved, the capability is off: one warning per process names
    it and what the run does instead."""
    moved = moved_names(capability)
    if moved:
        _warn_off(capability, moved)
    return not moved


def require(*capabilities: Capability) -> None:
    """Check the names of ``capabilities`` where they are about to be used.

    Raises:
        DependencyDriftError: names of theirs moved; it names each, its package's version, and the releases the
            package was written for.
    """
    moved = [found for capability in capabilities for found in moved_names(capability)]
    if moved:
        raise DependencyDriftError(drift_message(moved))


def check_for_run(spec: StrategySpec) -> None:
    """What a strategy checks when it is built: the core's names and those of the capabilities its ``spec`` asks
    for (:func:`require`). Every other capability is looked up where it is first used (:func:`available`), so a run
    imports nothing for a capability it does not use.

    Raises:
        DependencyDriftError: as :func:`require`.
    """
    require(CORE, *(capability for capability in OPTIONAL if capability.asked and capability.asked(spec)))


@functools.cache
def _warn_off(capability: Capability, moved: tuple[tuple[ForeignName, str], ...]) -> None:
    rank_zero_warn(off_warning(capability, list(moved)))
