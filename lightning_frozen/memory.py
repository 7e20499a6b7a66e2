"""Memory accounting for frozen training: the per-rank estimate and the summary logged at the start of ``fit``.

The model states follow the physical limit that docs/benchmarks.md measures against: frozen weights cost their
storage dtype / N per rank; each trainable element costs its weight, an fp32 master copy, its optimizer state and a
gradient. On top, ZeRO-3's two working buffers on the accelerator: the running module's params gathered whole, and a
gradient bucket of ``reduce_bucket_size`` elements allocated up front. Activations are not counted. DeepSpeed's own
estimators (``estimate_zero3_model_states_mem_needs_all_live``) count every param as trainable, the very cost frozen
training avoids. Loading in ``configure_model`` (host memory per node) and MoE bases: docs/large-models.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.base.loaded import LoadedBase
from lightning_frozen.errors import InvalidArgumentTypeError, InvalidArgumentValueError
from lightning_frozen.format.codec import storage_bytes
from lightning_frozen.optim import filtering
from lightning_frozen.spec import StrategySpec
from lightning_frozen.zero import frozen_files
from lightning_frozen.zero.config import fitted_reduce_bucket
from lightning_frozen.zero.frozen_storage import frozen_dtype_of
from lightning_frozen.zero.optimizers import inner_optimizer
from lightning_frozen.zero.params import full_numel, full_shape, local_shard

_PRECISION_BYTES = {
    "32": 4,
    "32-true": 4,
    "bf16": 2,
    "bf16-mixed": 2,
    "bf16-true": 2,
    "16": 2,
    "16-mixed": 2,
    "16-true": 2,
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, split by what holds them and where it lives."""

    trainable_params: int
    frozen_params: int
    world_size: int
    frozen_shards: int
    frozen_on: str
    trainable_weights: int
    gradients: int
    optimizer_state: int
    optimizer_on: str
    lr_zero_workaround_extra: int
    gathered_params: int = 0
    gradient_bucket: int = 0
    ranks_per_node: int = 1
    load_in_flight: int = 0
    # a rank's frozen shards while loading: quantized as they are read when the sliced loader reads them (a
    # `frozen_dtype` base arriving another way is held in the compute dtype until setup: `frozen_params` x its bytes)
    loaded_shards: int = 0
    # what the estimate assumed, echoed at the top of its table
    precision: str = "32-true"
    frozen_dtype: Optional[str] = None
    # a mixture of experts: top `experts_per_token` of `experts` run per token; `expert_params` of the frozen base
    # are experts' (all of them counted in its shards); `active_params` is what one token computes with
    experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    active_params: int = 0
    # bytes a step's forward gathers (its backward the frozen ones again): every param whole, every expert included
    gathered_per_step: int = 0

    @property
    def limit_bytes(self) -> int:
        """The model states alone, wherever they live: the physical limit per rank."""
        return self.frozen_shards + self.trainable_weights + self.gradients + self.optimizer_state

    @property
    def device_bytes(self) -> int:
        total = self.trainable_weights + self.gradients + self.gathered_params + self.gradient_bucket
        total += self.frozen_shards if self.frozen_on == "device" else 0
        total += self.optimizer_state if self.optimizer_on == "device" else 0
        return total

    @property
    def host_bytes(self) -> int:
        total = self.frozen_shards if self.frozen_on == "host" else 0
        total += self.optimizer_state if self.optimizer_on == "host" else 0
        return total

    @property
    def host_load_bytes(self) -> int:
        """Host memory per node while ``configure_model`` loads the base: the frozen base once (when its shards are
        offloaded) plus each rank's bytes in flight (``load_in_flight``)."""
        base = self.loaded_shards if self.frozen_on == "host" else 0
        return self.ranks_per_node * (base + self.load_in_flight)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "limit_bytes": self.limit_bytes,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "host_load_bytes": self.host_load_bytes,
        }

    def table(self) -> str:
        rows = [
            ("precision", self.precision, "Trainer's `precision`"),
            ("frozen dtype", str(self.frozen_dtype), "strategy's `frozen_dtype`"),
            ("trainable params", f"{self.trainable_params:,}", ""),
            ("frozen params", f"{self.frozen_params:,}", ""),
            ("ranks", str(self.world_size), ""),
            ("frozen shards / rank", format_bytes(self.frozen_shards), self.frozen_on),
            ("trainable weights / rank", format_bytes(self.trainable_weights), "device"),
            ("gradients / rank", format_bytes(self.gradients), "device"),
            ("optimizer state / rank", format_bytes(self.optimizer_state), self.optimizer_on),
            ("gathered module params", format_bytes(self.gathered_params), "device"),
            ("gradient bucket", format_bytes(self.gradient_bucket), "device"),
            ("device total / rank", format_bytes(self.device_bytes), ""),
            ("host total / rank", format_bytes(self.host_bytes), ""),
            ("load in flight / rank", format_bytes(self.load_in_flight), "host"),
            ("host at load / node", format_bytes(self.host_load_bytes), f"{self.ranks_per_node} rank(s)"),
            ("lr=0 workaround would add", format_bytes(self.lr_zero_workaround_extra), self.optimizer_on),
        ]
        if self.experts:
            rows[4:4] = [
                ("experts", f"top-{self.experts_per_token} of {self.experts}", "per token, per layer"),
                ("expert params", f"{self.expert_params:,}", "all in the frozen base"),
                ("active params / token", f"{self.active_params:,}", "the experts that run + the shared parts"),
            ]
            gathers = f"every layer's {self.experts} experts whole, {self.experts_per_token} run per token"
            rows.append(("gathered per forward", format_bytes(self.gathered_per_step), gathers))
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {value:>12}  {where}".rstrip() for name, value, where in rows)


def format_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} TiB"


def precision_bytes(precision: str) -> int:
    """Bytes of one element in the compute dtype of a Lightning precision string."""
    try:
        return _PRECISION_BYTES[str(precision)]
    except KeyError:
        raise InvalidArgumentValueError(
            f"Unknown precision {precision!r}; expected one of {sorted(_PRECISION_BYTES)}."
        ) from None


def _shard(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size)


def estimate_from_counts(
    trainable_params: int,
    frozen_params: int,
    world_size: int = 1,
    precision: str = "32-true",
    offload_frozen: bool = True,
    offload_optimizer: bool = False,
    optimizer_state_bytes: int = 8,
    largest_module_params: int = 0,
    reduce_bucket_size: int = 0,
    ranks_per_node: Optional[int] = None,
    frozen_dtype: Optional[str] = None,
) -> MemoryEstimate:
    """Per-rank bytes for a model of ``trainable_params`` + ``frozen_params`` elements under ZeRO-3; the largest
    module's elements and ``reduce_bucket_size`` size the two working buffers and what a rank loads in flight (0 leaves
    them out); ``ranks_per_node`` defaults to ``world_size``."""
    weight_bytes = precision_bytes(precision)
    trainable_shard = _shard(trainable_params, world_size)
    frozen_shard = _shard(frozen_params, world_size)
    optimizer_state = trainable_shard * (4 + optimizer_state_bytes)
    # the lr=0 workaround puts every frozen element in the optimizer: fp32 master + state + an fp32 gradient
    workaround = frozen_shard * (4 + optimizer_state_bytes + 4)
    # zero.Init's creation buffer (one module whole) + one tensor's slice read from the file + PEFT's fp32 adapters
    load_in_flight = (largest_module_params + _shard(largest_module_params, world_size)) * weight_bytes
    load_in_flight += trainable_params * 4
    return MemoryEstimate(
        trainable_params=trainable_params,
        frozen_params=frozen_params,
        world_size=world_size,
        frozen_shards=storage_bytes(frozen_shard, frozen_dtype, weight_bytes),
        frozen_on="host" if offload_frozen else "device",
        trainable_weights=trainable_shard * weight_bytes,
        gradients=trainable_shard * 4,
        optimizer_state=optimizer_state,
        optimizer_on="host" if offload_optimizer else "device",
        lr_zero_workaround_extra=workaround,
        gathered_params=largest_module_params * weight_bytes,
        gradient_bucket=reduce_bucket_size * weight_bytes if trainable_params else 0,
        ranks_per_node=world_size if ranks_per_node is None else ranks_per_node,
        load_in_flight=load_in_flight,
        loaded_shards=storage_bytes(frozen_shard, frozen_dtype, weight_bytes),
        precision=str(precision),
        frozen_dtype=frozen_dtype,
    )


def experts_of(model: nn.Module) -> tuple[int, int, int]:
    """``(experts, experts_per_token, expert_params)`` of a mixture-of-experts model, read from its transformers
    config (``num_experts_per_tok`` of ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``) and its fused
    expert tensors (3-D, one slice per expert); ``(0, 0, 0)`` for a dense model."""
    configs = (getattr(module, "config", None) for module in model.modules())
    config = next((c for c in configs if getattr(c, "num_experts_per_tok", None)), None)
    if config is None:
        return 0, 0, 0
    names = ("num_local_experts", "num_experts", "n_routed_experts")
    experts = next((int(getattr(config, n)) for n in names if getattr(config, n, None)), 0)
    shapes = (tuple(full_shape(p)) for p in model.parameters() if not p.requires_grad)
    expert_params = sum(math.prod(shape) for shape in shapes if len(shape) == 3 and shape[0] == experts)
    return (experts, int(config.num_experts_per_tok), expert_params) if expert_params else (0, 0, 0)


def largest_module_params(model: nn.Module) -> int:
    """Elements of the module with the most params of its own: ZeRO-3 gathers them whole while it runs."""
    return max((sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def estimate_memory(
    model: nn.Module,
    num_devices: int = 1,
    num_nodes: int = 1,
    precision: str = "32-true",
    offload_frozen: bool = True,
    offload_optimizer: bool = False,
    optimizer_state_bytes: int = 8,
    reduce_bucket_size: Optional[int] = None,
    print_table: bool = True,
    frozen_dtype: Optional[str] = None,
) -> MemoryEstimate:
    """Estimate per-rank memory of training ``model`` under ``frozen_deepspeed``; frozen = ``requires_grad=False``.

    Returns a :class:`MemoryEstimate` with device and host bytes for frozen shards, trainable weights,
    gradients, optimizer state (Adam-type by default: ``optimizer_state_bytes=8``) and ZeRO-3's two working
    buffers (the largest module's params gathered whole, and the gradient bucket of ``reduce_bucket_size``
    elements: by default what the strategy picks, the trainable elements up to Lightning's 2e8), the host memory
    per node that loading the base in ``configure_model`` needs (``host_load_bytes``), and prints its table, whose
    first rows say the ``precision`` and ``frozen_dtype`` it assumed. ``precision`` is the Trainer's: its default,
    ``"32-true"``, is this function's too, so pass the one the Trainer gets (``"bf16-mixed"`` halves the shards).
    ``frozen_dtype`` (``"int8"``/``"nf4"``, as the strategy's option) counts the frozen shards quantized: codes
    plus one scale per block. Activations are not included. The model may live on the ``meta`` device, so a 13B
    model can be estimated without allocating it, or be partitioned by ZeRO-3 already.

    On a mixture-of-experts model (a transformers config with ``num_experts_per_tok``) it also gives the experts
    (top k of E), the params in them (every expert, counted in the frozen shards at ``frozen_dtype``), the params one
    token computes with (``active_params``: all but the idle experts' share), and the bytes a forward gathers
    (``gathered_per_step``: every layer's fused experts whole, all E of them; ``gathered_params`` is the largest).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``num_devices`` / ``num_nodes`` not integers.
        ValueError: ``num_devices`` or ``num_nodes`` below 1, or an unknown ``precision``.
        FrozenDtypeError: an unknown ``frozen_dtype``.
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentTypeError(
            f"`estimate_memory`: `model` must be a torch.nn.Module (on `meta` is fine), got {model!r}."
        )
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (num_devices, num_nodes)):
        raise InvalidArgumentTypeError(
            f"`estimate_memory`: `num_devices` and `num_nodes` must be integers, got {num_devices!r} and {num_nodes!r}."
        )
    if num_devices < 1 or num_nodes < 1:
        raise InvalidArgumentValueError(f"num_devices and num_nodes must be >= 1, got {num_devices} and {num_nodes}.")
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    frozen = sum(full_numel(p) for p in model.parameters() if not p.requires_grad)
    estimate = estimate_from_counts(
        trainable,
        frozen,
        world_size=num_devices * num_nodes,
        precision=precision,
        offload_frozen=offload_frozen,
        offload_optimizer=offload_optimizer,
        optimizer_state_bytes=optimizer_state_bytes,
        largest_module_params=largest_module_params(model),
        reduce_bucket_size=fitted_reduce_bucket(trainable) if reduce_bucket_size is None else reduce_bucket_size,
        ranks_per_node=num_devices,
        frozen_dtype=frozen_dtype,
    )
    experts, per_token, expert_params = experts_of(model)
    estimate = replace(
        estimate,
        experts=experts,
        experts_per_token=per_token,
        expert_params=expert_params,
        active_params=trainable + frozen - (expert_params * (experts - per_token) // experts if experts else 0),
        gathered_per_step=(trainable + frozen) * precision_bytes(precision),
    )
    if print_table:
        print(estimate.table())
    return estimate


def measured_frozen_shard_bytes(frozen: list[nn.Parameter]) -> tuple[int, str]:
    """Bytes this rank holds of the frozen params' ZeRO-3 shards, and the device type they live on."""
    total, devices = 0, set()
    for tensor in map(local_shard, frozen):
        total += tensor.numel() * tensor.element_size()
        devices.add(tensor.device.type)
    return total, ",".join(sorted(devices)) or "-"


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def stored_as(frozen: list[nn.Parameter]) -> str:
    """How the frozen shards are stored: ``int8``/``nf4`` when quantized, else their dtype (``bf16``, ...)."""
    names = {frozen_dtype_of(p) or _DTYPE_NAMES.get(local_shard(p).dtype, str(local_shard(p).dtype)) for p in frozen}
    return ",".join(sorted(names)) or "-"


def run_summary(
    module: nn.Module,
    deepspeed_optimizer: Any,
    spec: StrategySpec,
    loaded: Optional[LoadedBase],
    precision: str,
    world_size: int,
    ranks_per_node: int,
) -> str:
    """The per-rank memory summary logged at the start of ``fit``: the estimate for the module's trainable and frozen
    params and its optimizer (sharded over the ranks by ZeRO-3) placed as ``spec`` says, and the frozen shard
    bytes measured here (``loaded``: what the sliced loader stored as it read)."""
    inner = inner_optimizer(deepspeed_optimizer)
    trainable, frozen = filtering.trainable_params(module), filtering.frozen_params(module)
    estimate = estimate_from_counts(
        trainable_params=sum(full_numel(p) for p in trainable),
        frozen_params=sum(full_numel(p) for p in frozen),
        world_size=world_size,
        precision=precision,
        offload_frozen=spec.offload_frozen,
        offload_optimizer=spec.offload_optimizer,
        optimizer_state_bytes=filtering.optimizer_state_bytes_per_param(inner),
        largest_module_params=largest_module_params(module),
        ranks_per_node=ranks_per_node,
        frozen_dtype=spec.frozen_dtype,
    )
    shard_bytes, shard_device = measured_frozen_shard_bytes(frozen)
    files = {frozen_files.file_of(p) for p in frozen}
    where = f"{shard_device} memory"
    if frozen and None not in files:  # the code cache's file: the page cache's, read as it is used
        where = f"a mapped file ({', '.join(sorted(map(str, files)))}: page cache, not this process's memory)"
    return (
        f"lightning-frozen: {estimate.trainable_params:,} trainable / {estimate.frozen_params:,} frozen params"
        f" on {world_size} rank(s). Per rank: frozen shards {format_bytes(shard_bytes)}"
        f" ({stored_as(frozen)}) in {where},"
        " trainable weights"
        f" {format_bytes(estimate.trainable_weights)},"
        f" optimizer state (fp32 master + moments) {format_bytes(estimate.optimizer_state)} on"
        f" {'host' if spec.offload_optimizer else 'device'}; the `lr=0` workaround would have added"
        f" {format_bytes(estimate.lr_zero_workaround_extra)} of optimizer state and gradients. Loading the"
        f" base in `configure_model` needs about {format_bytes(estimate.host_load_bytes)} of host memory"
        f" per node ({estimate.ranks_per_node} rank(s), each with"
        f" {format_bytes(estimate.load_in_flight)} in flight)." + _quantized_late(frozen, spec.frozen_dtype, loaded)
    )


def _quantized_late(frozen: list[nn.Parameter], frozen_dtype: Optional[str], loaded: Optional[LoadedBase]) -> str:
    """What frozen params that were not quantized while loading cost: the compute dtype until setup, per node."""
    if not frozen_dtype:
        return ""
    late = [p for p in frozen if loaded is None or not loaded.stored_while_loading(p)]
    if not late:
        return f" The frozen base was stored as {frozen_dtype} as it was read."
    held = sum(full_numel(p) * (2 if p.dtype in (torch.bfloat16, torch.float16) else 4) for p in late)
    return (
        f" {len(late)} of {len(frozen)} frozen params arrived another way (built in `__init__`, a `.bin` file, or"
        f" keys transformers converts) and were stored as {frozen_dtype} only at setup: until then the node"
        f" held them in the compute dtype, {format_bytes(held)}. `from_pretrained` of safetensors files in"
        " `configure_model` stores them as they are read."
    )
