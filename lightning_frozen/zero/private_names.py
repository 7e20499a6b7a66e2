"""DeepSpeed's and torch's private names that the seam overrides, calls or reads, one row each (written for DeepSpeed
0.19.8 and torch 2.13), checked when a strategy is built (``dependencies.py``); and the guard of a teardown's reaches
into DeepSpeed's internals, which must never hide the error that ended a run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_frozen.foreign_names import ForeignName, reach_warning

_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_INIT = "deepspeed.runtime.zero.partition_parameters:Init"
_OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
_MERGE = "deepspeed.utils.zero_to_fp32"
_KEPT = "a finished run's modules stay referenced until the process ends (their memory with them)"
_UNSHARD = "an attribute ZeRO-3 set on a module stays there after `unshard`"
_NO_PREFETCH = "a step that calls `self(...)` resets ZeRO-3's trace and nothing is prefetched (slower steps)"

# teardown's reaches into DeepSpeed, each guarded there by `reaching`
_RELEASE = "zero/engine.py's release_engine"
ENGINE_HOOKS = ForeignName(
    "deepspeed.runtime.engine:DeepSpeedEngine.__init__",
    _RELEASE,
    in_code=("module_forward_pre_hook", "module_forward_post_hook"),
    fallback=_KEPT,
)
MODULE_STACK = ForeignName(f"{_OFFLOAD}:FWD_MODULE_STACK", _RELEASE, fallback=_KEPT)
IN_FORWARD = ForeignName(
    f"{_OFFLOAD}:ZeROOrderedDict.__init__",
    _RELEASE,
    in_code=("_in_forward",),
    fallback="after a run that raised mid-forward, reading one of the module's params gathers it whole",
)
RELEASE_CACHE = ForeignName(
    "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator"
    "._PartitionedParameterCoordinator__params_to_release",
    _RELEASE,
    fallback=_KEPT,
)

DEEPSPEED = (
    # the ZeRO-3 optimizer: its inner state by param (scalars, keys), a sub-group's step that makes it, per-adapter
    # clipping (whole values read and written through deepspeed.utils' safe_get_* / safe_set_*)
    ForeignName(
        f"{_STAGE3}.__init__",
        "zero/params.py, zero/adapter_clipping.py, zero/engine.py",
        in_code=(
            "grad_position",
            "fp32_partitioned_groups_flat",
            "optimizer",
            "loss_scaler",
            "sub_group_to_group_id",
            "clip_grad",
            "parameter_offload",
        ),
    ),
    ForeignName(f"{_STAGE3}.get_param_id", "zero/params.py", ("self", "param")),
    ForeignName(f"{_STAGE3}._optimizer_step", "zero/params.py", ("self", "sub_group_id")),
    ForeignName(f"{_STAGE3}._get_norm_groups", "zero/adapter_clipping.py", ("self",), exact=True),
    ForeignName(
        f"{_STAGE3}.unscale_and_clip_grads",
        "zero/adapter_clipping.py",
        ("self", "sub_group_id", "total_norm"),
        exact=True,
    ),
    # zero.Init: a param's conversion and partitioning, replaced while from_pretrained loads
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
    # what ZeRO-3 sets on the modules it converts and hooks, removed by `zero/whole.unshard`
    ForeignName(
        "deepspeed.runtime.zero.partition_parameters:_init_external_params",
        "zero/whole.py",
        in_code=("_external_params", "ds_external_parameters", "all_parameters"),
        fallback=_UNSHARD,
    ),
    ForeignName(
        f"{_OFFLOAD}:_inject_parameters", "zero/whole.py", in_code=("_original_parameters",), fallback=_UNSHARD
    ),
    ForeignName(
        f"{_OFFLOAD}:DeepSpeedZeRoOffload._register_deepspeed_module",
        "zero/whole.py",
        in_code=("ds_recompute_parameters", "ds_grads_remaining", "applied_pre_backward_ref_cnt", "pre_bwd_fn"),
        fallback=_UNSHARD,
    ),
    ForeignName(
        f"{_OFFLOAD}:DeepSpeedZeRoOffload.__init__",
        "zero/whole.py",
        in_code=("ds_inflight_param_registry",),
        fallback=_UNSHARD,
    ),
    ForeignName(
        "deepspeed.runtime.zero.partition_parameters:InsertPostInitMethodToModuleSubClasses.patch_init_and_builtins",
        "zero/init.py",
        in_code=("_old_init", "_old_init_subclass", "_old_apply", "_old_apply_of_skip_init_hook", "__old_new__"),
    ),
    ForeignName(
        "deepspeed.runtime.zero.partition_parameters:InsertPostInitMethodToModuleSubClasses._enable_mem_efficient_linear",
        "zero/init.py",
        in_code=("linear_bk",),
        fallback="DeepSpeed's copy of `F.linear` stays on its class after a run",
    ),
    ForeignName(f"{_INIT}._aligned_size", "zero/placeholders.py", ("self", "param")),
    ForeignName(f"{_INIT}._partition_world_size", "zero/placeholders.py", ("self", "param")),
    ForeignName(
        f"{_INIT}._zero_init_param",
        "zero/placeholders.py",
        ("self", "param"),
        exact=True,
        fallback="every weight `from_pretrained` builds is broadcast whole from rank 0 (a slower load)",
    ),
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
    ForeignName("deepspeed.runtime.zero.partition_parameters:top_level_context", "zero/init.py"),
    # the param offload: its start-of-forward hook, its persistent params
    ForeignName(
        f"{_OFFLOAD}:DeepSpeedZeRoOffload.setup_zero_stage3_hooks",
        "zero/forward_trace.py",
        in_code=("fwd_pre_hook",),
        fallback=_NO_PREFETCH,
    ),
    ForeignName(f"{_OFFLOAD}:DeepSpeedZeRoOffload.__init__", "zero/forward_trace.py", in_code=("forward_hooks",)),
    ForeignName(
        f"{_OFFLOAD}:DeepSpeedZeRoOffload.__init__",
        "zero/engine.py",
        in_code=("persistent_parameters",),
        fallback="small frozen params stay whole on every rank after their first use (more memory)",
    ),
    # `generate` with a model gathered once: the coordinator releases its params first, and the hooks of its modules
    # call the offload's fetch and release through the instance (bypassed for the call), the post-forward one popping
    # the module stack the fetch pushed
    ForeignName(f"{_OFFLOAD}:DeepSpeedZeRoOffload.get_param_coordinator", "zero/gather_once.py", ("self",)),
    ForeignName(
        "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator.release_and_reset_all",
        "zero/gather_once.py",
        ("self", "module"),
    ),
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
    # the engine's counters, carried to a rebuilt engine
    ForeignName(
        "deepspeed.runtime.engine:DeepSpeedEngine.__init__",
        "zero/optimizers.py",
        in_code=("global_steps", "global_samples", "micro_steps", "skipped_steps"),
    ),
    # what a run leaves behind, cleared at its teardown
    ENGINE_HOOKS,
    MODULE_STACK,
    IN_FORWARD,
    RELEASE_CACHE,
    # the param groups kept by index: ZeRO-3 leaves frozen params out group by group, the engine drops empty groups
    ForeignName(
        f"{_STAGE3}._get_trainable_parameter_groups",
        "zero/optimizers.py",
        in_code=("is_optimized_parameter", "_ds_source_param_group_id"),
    ),
    ForeignName("deepspeed.runtime.engine:DeepSpeedEngine._configure_optimizer", "zero/optimizers.py"),
    # the accelerator, CPU Adam
    ForeignName(
        "deepspeed.accelerator.cpu_accelerator:CPU_Accelerator.__init__", "zero/accelerator.py", in_code=("_name",)
    ),
    ForeignName(
        "deepspeed.accelerator.cuda_accelerator:CUDA_Accelerator.__init__", "zero/accelerator.py", in_code=("_name",)
    ),
    ForeignName("deepspeed.ops.adam:DeepSpeedCPUAdam.__init__", "zero/optimizers.py", in_code=("adam_w_mode",)),
    # a stock DeepSpeed checkpoint directory, read by convert_deepspeed_checkpoint: the optimizer's moments merged (the
    # weights through zero_to_fp32's public function)
    ForeignName(
        f"{_MERGE}:_zero3_merge_trainable_params",
        "zero/checkpoint_files.py",
        ("state_dict", "world_size", "fp32_flat_groups", "zero_model_states"),
    ),
)

TORCH = (
    ForeignName(
        "torch.nn.modules.module:Module.__init__",
        "zero/engine.py, zero/params.py, zero/forward_trace.py, zero/compute/coded_linear.py",
        in_code=("_buffers", "_parameters", "_forward_pre_hooks", "_non_persistent_buffers_set"),
    ),
    ForeignName("torch:Tensor._version", "zero/params.py"),
    ForeignName("torch._C:_storage_Use_Count", "zero/compute/host_memory.py"),
    ForeignName("torch:UntypedStorage._cdata", "zero/compute/host_memory.py"),
    ForeignName("torch.optim.lr_scheduler:SequentialLR.__init__", "zero/optimizers.py", in_code=("_schedulers",)),
    ForeignName("torch.optim.lr_scheduler:ChainedScheduler.__init__", "zero/optimizers.py", in_code=("_schedulers",)),
)


@contextmanager
def reaching(row: ForeignName) -> Iterator[None]:
    """Run the block, a teardown's reach into ``row``'s name; where that name moved (``AttributeError``,
    ``KeyError``, ``ImportError``), skip the rest of the block with a warning that names it and says what that leaves
    behind: a teardown that raised would hide the error that ended the run."""
    try:
        yield
    except (AttributeError, KeyError, ImportError) as moved:
        rank_zero_warn(reach_warning(row, moved))
