"""Where ZeRO-3 puts frozen and trainable params and the module's buffers, and the engine built over them (its frozen
shards quantized when ``frozen_dtype`` says so).

DeepSpeed's ``offload_param`` moves every param to CPU memory, trainable ones too. We want only the frozen
shards there, so before ``deepspeed.initialize`` we convert the two sets with two ``deepspeed.zero.Init``
contexts: one whose ``remote_device`` is the CPU (frozen) and one that keeps shards on the accelerator
(trainable). DeepSpeed then finds every param already partitioned and leaves their placement alone; each
later all-gather copies a shard to the accelerator from wherever it lives.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from torch import nn

from lightning_frozen import process
from lightning_frozen.capabilities import HOOKS_WHERE_PARAMS, RELEASE, TRACE, available
from lightning_frozen.foreign_names import reaching
from lightning_frozen.spec import StrategySpec
from lightning_frozen.zero import forward_trace, frozen_storage
from lightning_frozen.zero.config import fit_reduce_bucket
from lightning_frozen.zero.frozen_compute import FrozenCompute
from lightning_frozen.zero.optimizers import keep_empty_groups
from lightning_frozen.zero.params import compute_dtype, full_numel, is_partitioned
from lightning_frozen.zero.whole import engine_additions_recorded


def place_model(model: nn.Module, config: Optional[dict], device: torch.device, spec: StrategySpec) -> None:
    """Shards and buffers where they belong, also for a model built under ``zero.Init`` in ``configure_model``."""
    if not spec.offload_param:
        place_shards(model, device, spec.offload_frozen, compute_dtype(config or {}) or torch.float32)
    place_placeholders(model, device)
    place_buffers(model, device)


def place_placeholders(model: nn.Module, device: torch.device) -> None:
    """Put each ZeRO-3 param's ``param.data`` on ``device``: its empty placeholder, or its whole value while gathered
    (Lightning's teardown moved them to the CPU, where DeepSpeed would gather; docs/internals.md)."""
    for param in model.parameters():
        if is_partitioned(param) and param.data.device != device:
            param.data = param.data.to(device)


@dataclass(frozen=True)
class Placement:
    """This rank's device, known once the ranks are set: where its trainable shards (and unoffloaded frozen ones) go."""

    device: torch.device
    device_rank: int  # what `deepspeed.initialize` takes as the device: the CUDA index, or the local rank on the CPU


class LoadedShards(Protocol):
    """What the engine reads of the strategy's record of the loaded base (``base/loaded.LoadedBase``)."""

    def settle(self, model: nn.Module) -> None: ...

    def source_keeper(self, fingerprint_mode: str) -> frozen_storage.SourceValues: ...


def initialize_engine(
    model: nn.Module,
    config: dict,
    spec: StrategySpec,
    where: Placement,
    compute: FrozenCompute,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    model_parameters: Optional[list[nn.Parameter]] = None,
    loaded: Optional[LoadedShards] = None,
    read_outside_forward: Sequence[tuple[nn.Module, list[nn.Parameter]]] = (),
) -> tuple[Any, Any]:
    """Partition and place the model's params as ``spec`` says, on ``where.device``, then ``deepspeed.initialize`` over
    them (a training engine when ``model_parameters`` are given); returns the engine and its (ZeRO) optimizer. Frozen
    params stay 1/N shards, quantized where ``spec.frozen_dtype`` says so; ``loaded`` is settled first.

    Raises:
        FrozenDtypeError: ``spec.frozen_dtype`` does not fit ``config`` or cannot run on ``where.device``.
    """
    import deepspeed

    # ZeRO-3 allocates its gradient reduce bucket whole up front and only trainable grads go in it: size it to them
    if model_parameters and spec.fit_reduce_bucket:
        fit_reduce_bucket(config, sum(full_numel(p) for p in model_parameters))
    compute.bound_gathers(config, model)  # on the CPU the gathered params are host memory, once per rank
    if spec.frozen_dtype:
        frozen_storage.check_config(spec.frozen_dtype, config, where.device)
    if loaded is not None:
        loaded.settle(model)
    partition_frozen_and_trainable(model, config, spec)
    place_model(model, config, where.device, spec)
    if optimizer is not None and model_parameters:
        keep_empty_groups(optimizer, model_parameters[0].dtype)  # placed: the dtype ZeRO-3 computes in
    # what the build adds to the modules (the external params registered up front included), for `unshard` to take off
    with engine_additions_recorded(model):
        for reader, params in read_outside_forward:  # registered up front: the first step's trace then holds them
            for param in params:
                deepspeed.zero.register_external_parameter(reader, param)
        settle_leaf_modules(model, config, read_outside_forward)
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=where.device_rank),
            config=config,
            model=model,
            model_parameters=model_parameters or [],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
    release_frozen_persistence(engine, model)
    if available(HOOKS_WHERE_PARAMS):
        hook_only_param_holders(engine, model)
    if available(TRACE):
        forward_trace.reset_trace_at_outermost_call(model, param_offload(engine))
    if spec.frozen_dtype:
        keeper = loaded.source_keeper(spec.fingerprint) if loaded is not None else None
        compute.prepare(model, spec.frozen_dtype, keeper, process.code_cache_place(spec.code_cache))
    return engine, deepspeed_optimizer


def settle_leaf_modules(model: nn.Module, config: dict, read_outside_forward: Sequence[tuple[nn.Module, list]]) -> None:
    """Write ``model``'s ZeRO-3 leaf modules into ``config`` (``zero_optimization.leaf_module``, by name): DeepSpeed's
    own choice, less those that hold trainable params, plus each module that holds a frozen param another module
    reads (``read_outside_forward``); why: docs/internals.md."""
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
    from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_module, z3_leaf_module
    from deepspeed.utils.z3_leaf_module import apply_zero_leaf_module_config

    zero = config.setdefault("zero_optimization", {})
    # the leaves DeepSpeed's initialize would flag, flagged now as it flags them (a rebuilt engine's too)
    apply_zero_leaf_module_config(model, DeepSpeedZeroLeafModuleConfig(**zero.get("leaf_module", {})))
    deepspeeds = {id(module) for module in get_z3_leaf_modules(model)}
    for module in get_z3_leaf_modules(model):
        if any(p.requires_grad for p in module.parameters()):
            set_z3_leaf_module(module, False)
    read = {id(param) for _, params in read_outside_forward for param in params if not param.requires_grad}
    for module in model.modules():
        if any(id(p) in read for p in module.parameters(recurse=False)):
            set_z3_leaf_module(module, True)
    leaves = [(name, module) for name, module in model.named_modules() if z3_leaf_module(module)]
    if {id(module) for _, module in leaves} != deepspeeds:  # else DeepSpeed's own config, which warns of no match
        zero["leaf_module"] = {"classes": [], "names": [name for name, _ in leaves], "name_suffixes": []}


def place_shards(model: nn.Module, device: torch.device, offload_frozen: bool, dtype: torch.dtype) -> None:
    """Put each ZeRO-3 shard where :func:`shard_device` says, in the compute ``dtype``: params built under
    ``zero.Init`` keep the placement and dtype they were built with, which DeepSpeed never changes, and its ZeRO-3
    optimizer needs every trainable shard in one dtype."""
    for param in model.parameters():
        if not is_partitioned(param):
            continue
        target = shard_device(param, device, offload_frozen)
        cast = param.ds_tensor.is_floating_point() and param.ds_tensor.dtype != dtype
        if param.ds_tensor.device != target or cast:
            param.ds_tensor.data = param.ds_tensor.data.to(target, dtype=dtype if cast else None)
        if cast:
            param.data = torch.empty(0, dtype=dtype, device=param.data.device)


def shard_device(param: nn.Parameter, device: torch.device, offload_frozen: bool) -> torch.device:
    """Where ``param``'s shard goes on a rank whose accelerator is ``device``: CPU memory for a frozen one when
    ``offload_frozen``, else ``device``, whatever ``remote_device`` it was created on."""
    return torch.device("cpu") if offload_frozen and not param.requires_grad else device


def place_buffers(model: nn.Module, device: torch.device) -> None:
    """Move every buffer (and torchmetrics state) of ``model`` to ``device``, leaving params alone: DeepSpeed skips
    ``module.to(device)`` for a model whose params are ZeRO-3 params already, and Lightning does not move it either."""
    for module in model.modules():
        if _is_metric(module):
            module.to(device)  # torchmetrics keeps its states outside the buffers and moves them in `_apply`
            continue
        for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
            if buffer.device != device:
                setattr(module, name, buffer.to(device))  # a registered buffer's name: replaced, persistence kept


def _is_metric(module: nn.Module) -> bool:
    metrics = sys.modules.get("torchmetrics")  # no torchmetrics imported, no metric in the model
    return metrics is not None and isinstance(module, metrics.Metric)


def partition_frozen_and_trainable(model: nn.Module, config: dict, spec: StrategySpec) -> None:
    """Turn the model's params not yet partitioned into ZeRO-3 shards: frozen ones in CPU memory if
    ``spec.offload_frozen`` (pinned with ``spec.pin_memory``). With ``offload_param`` DeepSpeed offloads them all."""
    import deepspeed

    if not spec.offload_frozen or spec.offload_param:
        return
    pending = [p for p in model.parameters() if not is_partitioned(p)]
    if not pending:
        return
    dtype = compute_dtype(config)
    if dtype is not None:
        # ZeRO-3 expects pre-partitioned params to be in the compute dtype already; the engine only checks.
        for param in pending:
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    frozen = [p for p in pending if not p.requires_grad]
    trainable = [p for p in pending if p.requires_grad]
    for params, remote_device in ((frozen, "cpu"), (trainable, None)):
        if params:
            deepspeed.zero.Init(
                module=nn.ParameterList(params),
                remote_device=remote_device,
                pin_memory=spec.pin_memory and remote_device == "cpu",
                config_dict_or_path=config,
                dtype=dtype or torch.float32,
            )


def release_frozen_persistence(engine: Any, model: nn.Module) -> None:
    """Keep frozen params as 1/N shards at all times: ZeRO-3 keeps small params (below
    ``stage3_param_persistence_threshold``) whole on every rank after their first use, which only pays for trainable
    ones."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    persistent = getattr(param_offload(engine), "persistent_parameters", None) if available(TRACE) else None
    if persistent is not None:
        persistent[:] = [p for p in persistent if p.requires_grad]
    for param in model.parameters():
        if param.requires_grad or not is_partitioned(param):
            continue
        param.ds_persist = False
        if param.ds_status == ZeroParamStatus.AVAILABLE:
            param.partition()


def hook_only_param_holders(engine: Any, model: nn.Module) -> int:
    """Take ZeRO-3's module hooks off ``model``'s modules (the engine's root aside) that hold no param: none of their
    own, none under them where they are a leaf, none registered as external; return how many. Around such a module
    the hooks fetch and release nothing, yet each forward runs four of them and wraps the module's outputs in two
    autograd nodes for its backward: in a 1.1B PEFT Llama, 446 modules of 735 (a LoRA layer's dicts and dropout, the
    wrappers, attention and MLP) and 0.1-0.2 s a step on a 2-core CPU (docs/internals.md, "Steadiness of a step").
    One of them with params under it may still read a child's weight in its forward: it keeps a light pair of hooks
    that give it DeepSpeed's back at the first such read (:class:`TrimmedHooks`)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    offload = param_offload(engine)
    idle = {}
    for module in model.modules():
        if module is not model and next(iter(iter_params(module, recurse=z3_leaf_module(module))), None) is None:
            idle[id(module._forward_pre_hooks)] = idle[id(module._forward_hooks)] = module
    taken: dict[int, TrimmedHooks] = {}
    for hooks_of_kind in (offload.forward_hooks, offload.backward_hooks):
        for handle in hooks_of_kind:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and id(hooks) in idle and handle.id in hooks:
                module = idle[id(hooks)]
                trimmed = taken.setdefault(id(module), TrimmedHooks(offload))
                kind = (hooks is module._forward_pre_hooks, hooks_of_kind is offload.forward_hooks)
                trimmed.hooks.append((*kind, hooks[handle.id]))
                handle.remove()
    for module in model.modules():
        trimmed = taken.get(id(module))
        if trimmed is not None and len(trimmed.hooks) == 4 and next(module.parameters(), None) is not None:
            trimmed.watch(module)
    return len(taken)


class TrimmedHooks:
    """A module's ZeRO-3 hooks, taken off, and two light ones that put the module on DeepSpeed's module stack while it
    runs. A child's weight its forward reads (``F.linear(x, self.lin.weight)``; ``nn.TransformerEncoderLayer`` reads
    ``self_attn.in_proj_bias`` in eval; PEFT's LoRA layer ``lora_A.weight.dtype``) is then registered on it, as under
    stock ZeRO-3, and not on the nearest module still hooked (up to the root, which would fetch it at every forward and
    hold it through the forward and the backward). The forward that reads one gives the module DeepSpeed's hooks back
    and ends as they would have ended it: the weight released, fetched again for the module's backward and released
    after it."""

    def __init__(self, offload: Any) -> None:
        from deepspeed.runtime.zero import parameter_offload, partition_parameters, partitioned_param_coordinator

        self.offload = offload
        self.module_stack = parameter_offload.FWD_MODULE_STACK  # a weight read in a forward registers on its last
        self.iter_params = partitioned_param_coordinator.iter_params
        self.unregister = partition_parameters.unregister_external_parameter
        self.hooks: list[tuple] = []  # (a pre-forward hook, in the offload's `forward_hooks`, the hook) as registered
        self.handles: tuple[Any, ...] = ()

    def watch(self, module: nn.Module) -> None:
        self.handles = (module.register_forward_pre_hook(self.enter), module.register_forward_hook(self.leave))
        self.offload.forward_hooks.extend(self.handles)  # removed with DeepSpeed's own when the engine goes

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.module_stack.append(module)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        read = list(self.iter_params(module))  # it holds none: what it read of a child's, registered on it
        if all(param.ds_persist for param in read):  # none, or ones kept whole once gathered (a small `lora_A.weight`
            for param in read:  # read before `lora_A` first ran): nothing to release or to fetch again
                self.unregister(module, param)
            self.module_stack.pop()
            return None
        return self.give_back(module, args, output)

    def give_back(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """DeepSpeed's hooks on ``module`` again, and the forward that read a child's weight ended as they would have
        ended it; returns its outputs, wrapped for its backward."""
        for handle in self.handles:
            handle.remove()
        hooks = {}
        for pre_forward, forward_kind, hook in self.hooks:  # in DeepSpeed's order, after the module's other hooks
            handle = module.register_forward_pre_hook(hook) if pre_forward else module.register_forward_hook(hook)
            (self.offload.forward_hooks if forward_kind else self.offload.backward_hooks).append(handle)
            hooks[pre_forward, forward_kind] = hook
        hooks[False, True](module, args, output)  # the end of its forward: off the stack, the weight released
        output = hooks[False, False](module, args, output)  # its outputs: the weight fetched before its backward
        inputs = [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad]
        waiting = [len(inputs)]

        def after_backward(grad: torch.Tensor) -> None:  # the gradient of its last input: the weight released
            waiting[0] -= 1
            if not waiting[0]:  # (where its backward did not run, the root's holds the engine's backward open)
                self.offload.post_sub_module_backward_function(module)

        for tensor in inputs if torch.is_grad_enabled() else ():
            tensor.register_hook(after_backward)
        return output


def param_offload(engine: Any) -> Any:
    """The engine's ``DeepSpeedZeRoOffload``: its ZeRO-3 optimizer's, or the engine's optimizer itself without one."""
    return getattr(engine.optimizer, "parameter_offload", None) or getattr(engine, "optimizer", None)


def destroy_engine(engine: Any, model: nn.Module, refrozen: list[nn.Parameter], offload_frozen: bool) -> None:
    """Destroy a training engine before another is built over the same ``model``: DeepSpeed's hooks come off the
    module, and ``refrozen`` params (they stop training) get shards of their own (:func:`detach_frozen_shards`)."""
    engine.destroy()
    remove_module_hooks(model)
    detach_frozen_shards(refrozen, offload_frozen)


def detach_frozen_shards(params: list[nn.Parameter], offload: bool) -> None:
    """Give params that just stopped training shards of their own (in CPU memory if ``offload``): a trainable shard
    is a view into its ZeRO optimizer's flat buffer, which a frozen one must not keep alive."""
    for param in params:
        if is_partitioned(param):
            device = torch.device("cpu") if offload else param.ds_tensor.device
            param.ds_tensor.data = param.ds_tensor.data.to(device, copy=True)


def release_engine(engine: Any, model: nn.Module) -> None:
    """After a run over ``model`` (returned or raised): let the process forget ``engine`` (or a plain module) so that
    the engine, its ZeRO optimizer and ``model`` with its frozen shards are freed once the caller drops them; the
    module keeps its shards and works under the next engine built over it. What DeepSpeed holds: docs/internals.md."""
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    forward_trace.restore_trace_reset(model)  # DeepSpeed's own start-of-forward hook again, before `destroy` drops it
    if isinstance(engine, DeepSpeedEngine):
        engine.destroy()  # removing hooks twice is harmless, so an engine already destroyed may come again
    if available(RELEASE):  # else warned when the strategy was built: what a run leaves in DeepSpeed stays
        _release_deepspeeds_references(engine, model)
    for param in model.parameters():
        if is_partitioned(param) and param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_persist:
            param.partition()


def _release_deepspeeds_references(engine: Any, model: nn.Module) -> None:
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero import parameter_offload

    if isinstance(engine, DeepSpeedEngine):
        with reaching(RELEASE):
            for handle in (engine.module_forward_pre_hook, engine.module_forward_post_hook):  # `destroy` leaves these
                if handle is not None:
                    handle.remove()
    with reaching(RELEASE):
        _params_to_release_cache().cache_clear()  # its keys hold every coordinator and module it saw, for good
    ours = {id(module) for module in model.modules()}
    with reaching(RELEASE):
        parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in ours]
    with reaching(RELEASE):
        for module in model.modules():  # a raise mid-forward skips the engine's epilogue: reading a param gathers it
            if isinstance(module._parameters, parameter_offload.ZeROOrderedDict):
                module._parameters._in_forward = False


def _params_to_release_cache() -> Any:
    """The ``functools.lru_cache`` on ``PartitionedParameterCoordinator.__params_to_release``: a cache on the class,
    keyed by (coordinator, module, step), filled once ZeRO-3's trace is complete (prefetching), never emptied; None
    where DeepSpeed no longer caches it (then ``reaching`` meets the AttributeError of clearing it, not a StopIteration
    that ``contextmanager`` would re-raise)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    method = vars(PartitionedParameterCoordinator)["_PartitionedParameterCoordinator__params_to_release"]
    # under DeepSpeed's `instrument_w_nvtx`, which keeps the cached function in its closure (no `__wrapped__`)
    inner = (
        [cell.cell_contents for cell in method.__closure__ or ()] if not hasattr(method, "cache_clear") else [method]
    )
    return next((function for function in inner if hasattr(function, "cache_clear")), None)
