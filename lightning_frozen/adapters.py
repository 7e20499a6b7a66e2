"""Several PEFT LoRA adapters trained at once on one frozen base, each exactly as if it trained alone.

A PEFT model holds several adapters (``get_peft_model(base, cfg, adapter_name="a")``, then ``add_adapter("b", cfg)``).
:func:`train_adapters` makes the named ones trainable. Each batch carries a block of rows per adapter
(:func:`sweep_batch` repeats one batch for every adapter, :func:`multitask_batch` joins one batch per adapter), and
inside :func:`adapter_rows` every LoRA layer adds to each row its own adapter only: the frozen layer's matmul (and
ZeRO-3's gather of its weight) runs once over the rows of all adapters, each adapter's LoRA matmuls over its block.
:func:`adapter_losses` gives each adapter the mean over its own rows; their sum gives every adapter exactly its own
gradient, since the adapters' params are disjoint and each row's output depends on its own adapter only (a mean over
all rows would scale each by 1/K).

Under ``frozen_deepspeed`` the strategy does the rest when two or more adapters train: each optimizer param group
must hold one adapter's params (:func:`check_optimizer_groups`), a training forward outside :func:`adapter_rows`
raises unless it is inside :func:`shared_rows` (``row_guard.py``), gradients are clipped per adapter
(``zero/adapter_clipping.py``), and each adapter loads and exports alone from the run's checkpoint
(``checkpoint/adapter_entries.py``).

Exact only where no random number or statistic depends on the other rows: ``lora_dropout=0`` and the base's own
dropout off (K adapters' rows draw other random numbers than one adapter's alone), and no layer that mixes rows
(BatchNorm in train mode).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_frozen.anatomy import Anatomy, adapter_param_names, trained_adapters
from lightning_frozen.capabilities import SEVERAL_ADAPTERS, require
from lightning_frozen.errors import AdapterSetupError, format_names
from lightning_frozen.hf import checkpointing, peft_adapters, row_guard
from lightning_frozen.hf.reference import find_peft_model
from lightning_frozen.zero import adapter_clipping


def _peft_model(model: nn.Module) -> Any:
    found = find_peft_model(model)
    if found is None:
        raise AdapterSetupError(
            f"`{type(model).__name__}` holds no PEFT model, so it has no adapters to train at once. Build it with"
            " `peft.get_peft_model(base, config, adapter_name=...)` and `add_adapter(name, config)`."
        )
    return found[1]


def train_adapters(model: nn.Module, names: Sequence[str]) -> None:
    """Make exactly the adapters ``names`` of the PEFT model in ``model`` trainable and active, to train at once.

    Raises:
        AdapterSetupError: a name the PEFT model does not hold; an adapter that is not plain LoRA (another tuner,
            DoRA, ``modules_to_save`` or trainable tokens, which PEFT cannot compute per row), or that adapts a layer
            type PEFT cannot mix in one batch.
    """
    peft_model = _peft_model(model)
    names = list(names)
    unknown = [name for name in names if name not in peft_model.peft_config]
    if not names or unknown:
        raise AdapterSetupError(
            f"{'Adapters ' + format_names(unknown) + ' are' if unknown else 'No adapter is'} named for training;"
            f" the PEFT model holds {format_names(list(peft_model.peft_config))}. Name adapters it holds, or add"
            " them first with `model.add_adapter(name, config)`."
        )
    for name in names:
        _check_mixable(peft_model, name)
    peft_model.base_model.set_adapter(names)  # PeftModel.set_adapter takes one name; the tuner takes a list
    if any(float(peft_model.peft_config[name].lora_dropout or 0.0) for name in names):
        rank_zero_warn(
            "lightning-frozen: adapters trained at once with `lora_dropout > 0` draw other random numbers than each"
            " would alone, so they train well but not identically to separate runs; set `lora_dropout=0` for that."
        )


def _check_mixable(peft_model: Any, name: str) -> None:
    config = peft_model.peft_config[name]
    peft_type = getattr(config.peft_type, "value", config.peft_type)
    fix = "Train it in a run of its own, or use a plain LoRA config"
    if peft_type != "LORA":
        raise AdapterSetupError(
            f"Adapter `{name}` is {peft_type}; only LoRA adapters can be trained at once (each row of a batch computed"
            f" with its own adapter). {fix}."
        )
    reason = None
    if getattr(config, "use_dora", False):
        reason = "DoRA"
    elif getattr(config, "modules_to_save", None) or getattr(config, "trainable_token_indices", None):
        reason = "`modules_to_save` / `trainable_token_indices` (trained copies PEFT does not compute per row)"
    if reason:
        raise AdapterSetupError(
            f"Adapter `{name}` uses {reason}, which PEFT cannot mix in one batch. {fix} (a head can be a LoRA target:"
            " `target_modules=[..., 'classifier']`)."
        )
    unmixable = peft_adapters.unmixable_layers(peft_model, name)
    if unmixable:
        layer_name, layer_type = unmixable[0]
        raise AdapterSetupError(
            f"Adapter `{name}` adapts `{layer_name}` with PEFT's `{layer_type}` (or a LoRA variant), which"
            f" lightning-frozen cannot compute per row (plain LoRA on Linear and Conv layers only). {fix} without that"
            " target module."
        )


@dataclass(frozen=True)
class AdapterRows:
    """Which adapter each row of a batch is for: consecutive blocks, ``(adapter, number of rows)`` in batch order."""

    blocks: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.blocks]
        if len(set(names)) != len(names):
            raise AdapterSetupError(f"Adapter rows name an adapter twice ({names}); give each adapter one block.")

    @property
    def adapters(self) -> list[str]:
        return [name for name, _ in self.blocks]

    @property
    def total(self) -> int:
        return sum(size for _, size in self.blocks)

    def slices(self) -> dict[str, slice]:
        """Each adapter's rows as a slice of the batch."""
        found, start = {}, 0
        for name, size in self.blocks:
            found[name] = slice(start, start + size)
            start += size
        return found


def _rows_of(batch: Any) -> Optional[int]:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    return next((rows for rows in map(_rows_of, values) if rows is not None), None)


def _join(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not first.dim():
            return first
        if any(part.shape[1:] != first.shape[1:] for part in parts):
            raise AdapterSetupError(
                f"The adapters' batches hold tensors of shapes {[tuple(p.shape) for p in parts]}, which cannot be"
                " joined into one batch. Pad every task to the same length (e.g. `padding='max_length'`)."
            )
        return torch.cat(list(parts))
    if isinstance(first, Mapping):
        return type(first)({key: _join([part[key] for part in parts]) for key in first})
    if isinstance(first, (list, tuple)) and not isinstance(first, str):
        joined = [_join([part[i] for part in parts]) for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    return first


def sweep_batch(batch: Any, adapters: Sequence[str]) -> tuple[Any, AdapterRows]:
    """A sweep's batch: every tensor of ``batch`` (nested in dicts, lists, tuples) repeated along dim 0, once per
    adapter, so every adapter sees every row; returns it with its :class:`AdapterRows`. Other values stay as they are.
    """
    rows = _rows_of(batch)
    if rows is None:
        raise AdapterSetupError("The batch holds no tensor with a batch dimension, so it has no rows to give adapters.")
    adapters = list(adapters)
    return _join([batch] * len(adapters)), AdapterRows(tuple((name, rows) for name in adapters))


def multitask_batch(batches: Mapping[str, Any]) -> tuple[Any, AdapterRows]:
    """One batch from one batch per adapter (``{"a": batch_a, "b": batch_b}``, as Lightning's ``CombinedLoader``
    gives for a dict of DataLoaders), joined along dim 0 in the dict's order, with its :class:`AdapterRows`.

    Raises:
        AdapterSetupError: the batches' tensors differ in shape beyond dim 0.
    """
    names = list(batches)
    sizes = [_rows_of(batches[name]) for name in names]
    if not names or None in sizes:
        raise AdapterSetupError("Each adapter's batch must hold tensors with a batch dimension.")
    return _join([batches[name] for name in names]), AdapterRows(tuple(zip(names, sizes)))  # type: ignore[arg-type]


@contextmanager
def adapter_rows(model: nn.Module, rows: AdapterRows) -> Iterator[None]:
    """Within the context, every LoRA layer of ``model`` adds to each row the adapter ``rows`` names for it (none
    where that adapter does not adapt the layer), in training and in evaluation.

    With gradient checkpointing on (Hugging Face's ``gradient_checkpointing_enable()``), each checkpointed block's
    forward carries ``rows`` with it, so that its recomputation during backward, after the context has ended, gives
    every row its adapter again.

    Raises:
        AdapterSetupError: a layer's input has another number of rows than ``rows`` (a model that reshapes its batch
            dimension before a LoRA layer), an adapter ``rows`` names is not in the model, or a module checkpoints
            its forward in a way other than Hugging Face's, which cannot carry ``rows``.
    """
    peft_model = _peft_model(model)
    unknown = [name for name in rows.adapters if name not in peft_model.peft_config]
    if unknown:
        raise AdapterSetupError(
            f"Rows for adapters {format_names(unknown)}, which the PEFT model does not hold (it holds"
            f" {format_names(list(peft_model.peft_config))})."
        )
    checkpointed, unreachable = checkpointing.checkpointing_modules(model)
    if torch.is_grad_enabled() and unreachable:
        raise AdapterSetupError(
            "Gradient checkpointing recomputes the forward during backward, after `adapter_rows` has ended, and"
            f" `{type(unreachable[0]).__name__}` checkpoints in a way (not Hugging Face's) through which its recomputed"
            " rows cannot be given their adapters. Turn it off (`model.gradient_checkpointing_disable()`) to train"
            " adapters at once."
        )
    install = partial(_rows_installed, peft_model, peft_adapters.lora_row_layers(peft_model), rows)
    with ExitStack() as stack:
        for module in checkpointed:
            stack.enter_context(checkpointing.recomputed_within(module, install))
        stack.enter_context(install())
        yield


@contextmanager
def _rows_installed(peft_model: Any, layers: list[nn.Module], rows: AdapterRows) -> Iterator[None]:
    """``rows`` given to each of ``layers`` and to the row guard, for the context; whatever forward a layer instance
    held before (rows of an enclosing context, another library's hook) is put back after."""
    missing = object()
    before = {layer: layer.__dict__.get("forward", missing) for layer in layers}
    for layer in layers:
        layer.forward = partial(_row_forward, layer, rows)  # an instance attribute shadows the class's forward
    try:
        with row_guard.rows_given(peft_model):
            yield
    finally:
        for layer, forward in before.items():
            if forward is missing:
                del layer.forward
            else:
                layer.forward = forward


@contextmanager
def shared_rows(model: nn.Module) -> Iterator[None]:
    """Within the context, every row goes through every active adapter, as PEFT computes it (stacked adapters trained
    together on the same data, on purpose): the way to say so under ``frozen_deepspeed``, which refuses a training
    forward of two or more trained adapters outside :func:`adapter_rows` (:func:`guard_rows`). The adapters' gradients
    are then coupled: each one's depends on the others'.

    Raises:
        AdapterSetupError: ``model`` holds no PEFT model.
    """
    with row_guard.rows_given(_peft_model(model)):
        yield


def guard_rows(anatomy: Anatomy, hooks: ExitStack) -> None:
    """With two or more adapters of the module training (its ``anatomy`` says), a forward with gradients that adds two
    or more of them to every row outside :func:`adapter_rows` and :func:`shared_rows` raises
    :class:`AdapterSetupError` (``row_guard.py``); the check's hooks go into ``hooks``, and closing it removes them."""
    trained = frozenset(anatomy.trained_adapters)
    if anatomy.peft is not None and len(trained) >= 2:
        row_guard.guard(anatomy.peft[1], trained, hooks)


def _row_forward(layer: Any, rows: AdapterRows, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    # PEFT's vanilla LoRA forward on each adapter's block of rows. Not PEFT's `_mixed_batch_forward`: it visits
    # adapters in `set` order, which differs between processes, and ZeRO-3 needs every rank to run the same modules
    # in the same order.
    if layer.merged or layer.disable_adapters:
        raise AdapterSetupError(
            f"A `{type(layer).__name__}` layer has merged or disabled adapters; unmerge (`unmerge_adapter()`) and"
            " enable them before training adapters at once."
        )
    if len(x) != rows.total:
        raise AdapterSetupError(
            f"A `{type(layer).__name__}` LoRA layer got {len(x)} rows where the batch has {rows.total}: the model"
            " reshapes its batch dimension before this layer, so rows cannot be given their own adapters there."
        )
    return peft_adapters.lora_forward_by_rows(layer, rows.slices(), x, *args, **kwargs)


def adapter_losses(
    values: torch.Tensor, rows: AdapterRows, weights: Optional[torch.Tensor] = None
) -> dict[str, torch.Tensor]:
    """Each adapter's loss: the mean of ``values`` (one per row, or per row and token) over its rows, or with
    ``weights`` (e.g. a token mask, the shape of ``values``) the weighted mean. Return ``sum(losses.values())`` from
    ``training_step``: each adapter then gets exactly the gradient of its own loss."""
    losses = {}
    for name, rows_of_adapter in rows.slices().items():
        part = values[rows_of_adapter]
        if weights is None:
            losses[name] = part.mean()
        else:
            weight = weights[rows_of_adapter].to(part.dtype)
            losses[name] = (part * weight).sum() / weight.sum()
    return losses


def adapter_param_groups(module: nn.Module, hyper_parameters: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """One optimizer param group per adapter, in the order of ``hyper_parameters`` (``{"a": {"lr": 1e-3}, ...}``):
    the adapter's trainable params with its own hyper-parameters. A ``LambdaLR`` with one lambda per adapter, in the
    same order, gives each adapter its own schedule; ``"gradient_clip_val"`` gives it its own clipping value (else the
    Trainer's ``gradient_clip_val`` applies to it).

    Raises:
        AdapterSetupError: an adapter the module does not train.
    """
    params = dict(module.named_parameters())
    owned = adapter_param_names(module)
    groups = []
    for name, hyper in hyper_parameters.items():
        trainable = [params[n] for n in owned.get(name, []) if params[n].requires_grad]
        if not trainable:
            raise AdapterSetupError(
                f"Adapter `{name}` has no trainable params in `{type(module).__name__}` (it trains"
                f" {format_names(trained_adapters(module))}). Name it in `lightning_frozen.adapters.train_adapters`."
            )
        groups.append({"params": trainable, **hyper})
    return groups


def group_adapters(anatomy: Anatomy, group_names: Sequence[Sequence[str]]) -> list[Optional[str]]:
    """The adapter each optimizer param group of the module trains (groups given by the names of their trainable
    params; the module's ``anatomy`` says which adapter owns each; None for a group that trains nothing), or ``[]``
    when fewer than two adapters train (nothing to keep apart).

    Raises:
        AdapterSetupError: a group holds params of several adapters, or a trainable param belongs to no adapter
            (shared by all, it would couple them).
    """
    trained = list(anatomy.trained_adapters)
    if len(trained) < 2:
        return []
    owner = {name: adapter for adapter, names in anatomy.adapter_params.items() for name in names}
    shared = [name for name in anatomy.trainable if name not in owner]
    if shared:
        raise AdapterSetupError(
            f"Adapters {format_names(trained)} train at once, and trainable params {format_names(shared)} belong to"
            " none of them, so every adapter's rows would train them together. Freeze them, or make them part of"
            " each adapter (a LoRA target module)."
        )
    adapters: list[Optional[str]] = []
    for index, names in enumerate(group_names):
        found = list(dict.fromkeys(owner[name] for name in names))
        if len(found) > 1:
            raise AdapterSetupError(
                f"Optimizer param group {index} holds params of adapters {format_names(found)}, which train at once:"
                " each adapter needs its own group(s) for its own hyper-parameters, schedule and gradient clipping."
                " Build the groups with `lightning_frozen.adapters.adapter_param_groups(self, {name: {...}})`."
            )
        adapters.append(found[0] if found else None)
    return adapters


def check_optimizer_groups(module: nn.Module, anatomy: Anatomy, optimizer: Optimizer) -> None:
    """:func:`group_adapters` for a torch optimizer over ``module``'s params (of that ``anatomy``), and the clipping
    values of its groups (``gradient_clip_val``): one per adapter, and only where two or more adapters train.

    Raises:
        AdapterSetupError: as :func:`group_adapters`; an adapter whose groups give different clipping values; a
            clipping value in a group while fewer than two adapters train.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    groups = optimizer.param_groups
    trained = [[names[id(p)] for p in group["params"] if p.requires_grad] for group in groups]
    adapters = group_adapters(anatomy, trained)
    adapter_clipping.check_group_clips(adapters, groups, anatomy.trained_adapters)


def engine_built(
    zero_optimizer: Any, anatomy: Anatomy, group_names: Sequence[Sequence[str]], row_hooks: ExitStack
) -> None:
    """Once the strategy built its engine over a module of that ``anatomy``, with two or more adapters training: clip
    each one's gradients in ``zero_optimizer`` by its own norm and refuse a training forward outside
    :func:`adapter_rows` (:func:`guard_rows`, its hooks in ``row_hooks``, emptied first). Raises as
    :func:`group_adapters` does, and :class:`DependencyDriftError` where ``capabilities.SEVERAL_ADAPTERS`` moved."""
    if len(anatomy.trained_adapters) >= 2:
        require(SEVERAL_ADAPTERS)
    adapter_clipping.clip_per_adapter(zero_optimizer, group_adapters(anatomy, group_names))
    row_hooks.close()
    guard_rows(anatomy, row_hooks)
