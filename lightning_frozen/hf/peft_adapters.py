"""What the package uses of a PEFT model's internals, all in one place (written for PEFT 0.21): where PEFT creates
adapters (:func:`around_adapter_creation`), which params each adapter owns, LoRA's forward on blocks of rows from its
parts (plain ``Linear`` and ``Conv`` layers), and the ``PeftModel`` and ``ModulesToSaveWrapper`` instances of a
module. The finders return nothing before ``peft`` is imported rather than import it (~20 MiB).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.capabilities import PEFT_LAYERS, available


@contextmanager
def around_adapter_creation(enter: Callable[[], None], leave: Callable[[], None]) -> Iterator[None]:
    """While active, ``PeftModel.__init__`` and ``BaseTuner.inject_adapter`` call ``enter()`` before the outermost of
    those calls and ``leave()`` after it (class-wide; nothing without PEFT or with ``capabilities.PEFT_LAYERS`` off).
    """
    if importlib.util.find_spec("peft") is None or not available(PEFT_LAYERS):
        yield
        return
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    originals = {(PeftModel, "__init__"): PeftModel.__init__, (BaseTuner, "inject_adapter"): BaseTuner.inject_adapter}
    depth = 0  # PeftModel.__init__ calls inject_adapter: only the outermost call enters and leaves

    def wrapped(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal depth
            if depth == 0:
                enter()
            depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth -= 1
                if depth == 0:
                    leave()

        return wrapper

    for (owner, name), method in originals.items():
        setattr(owner, name, wrapped(method))
    try:
        yield
    finally:
        for (owner, name), method in originals.items():
            setattr(owner, name, method)


def is_peft_model(module: Any) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (False while ``peft`` is not imported: nothing can be one)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(module, PeftModel)


def is_modules_to_save_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is PEFT's ``ModulesToSaveWrapper`` (False while ``peft`` is not imported)."""
    if "peft" not in sys.modules:
        return False
    from peft.utils import ModulesToSaveWrapper

    return isinstance(module, ModulesToSaveWrapper)


def tuner_layer_params(module: nn.Module) -> dict[str, list[str]]:
    """The params of each adapter in the PEFT tuner layers and ``modules_to_save`` wrappers inside ``module``, by their
    names in ``module``, adapters in the order the layers hold them; empty without PEFT."""
    owned: dict[str, list[str]] = {}
    for prefix, layer in module.named_modules():
        add_tuner_layer_params(owned, prefix, layer)
    return owned


def holds_tuner_layers(module: nn.Module) -> bool:
    """Whether ``module`` holds a PEFT tuner layer or ``modules_to_save`` wrapper, whose adapters' params only PEFT's
    layer internals name (``capabilities.PEFT_LAYERS``); False where PEFT is not imported (then none is held)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    return any(isinstance(layer, (BaseTunerLayer, ModulesToSaveWrapper)) for layer in module.modules())


def add_tuner_layer_params(owned: dict[str, list[str]], prefix: str, layer: nn.Module) -> None:
    """If ``layer`` (named ``prefix``) is a PEFT tuner layer or a ``modules_to_save`` wrapper (whose trained copy is its
    adapter's), add each of its adapters' params to ``owned`` by name."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    if not isinstance(layer, (BaseTunerLayer, ModulesToSaveWrapper)):
        return
    for attribute in layer.adapter_layer_names:
        container = getattr(layer, attribute, None)
        for adapter, held in container.items() if container is not None else []:
            lead = f"{prefix}.{attribute}.{adapter}"
            named = held.named_parameters() if isinstance(held, nn.Module) else [("", held)]
            owned.setdefault(adapter, []).extend(f"{lead}.{n}" if n else lead for n, _ in named)


def params_read_outside_forward(module: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Each PEFT ``ParamWrapper`` inside ``module`` (LoRA on a param itself, ``target_parameters``: a MoE's fused
    experts) with the params its forward reads without calling the modules that hold them: the targeted param and
    each adapter's LoRA A and B weights. Empty without PEFT."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora.layer import ParamWrapper

    return [
        (
            layer,
            [layer.get_param(), *[lora[adapter].weight for lora in (layer.lora_A, layer.lora_B) for adapter in lora]],
        )
        for layer in module.modules()
        if isinstance(layer, ParamWrapper)
    ]


class ParamWrapperLora:
    """PEFT's ``ParamWrapper`` (LoRA on a param itself, ``target_parameters``) as ``zero/compute/coded_experts.py``
    reads it, handed down to it (that floor reads no PEFT name): a MoE layer's routed experts add each wrapper's LoRA
    factors beside their own matmuls, where PEFT would add ``scaling * lhs @ rhs`` to the whole fused param."""

    @staticmethod
    def target(module: Optional[nn.Module]) -> Optional[str]:
        if module is None or "peft" not in sys.modules:
            return None
        from peft.tuners.lora.layer import ParamWrapper

        return module.parameter_name if isinstance(module, ParamWrapper) else None

    @staticmethod
    def wrapped(wrapper: nn.Module) -> nn.Module:
        return wrapper.base_layer

    @staticmethod
    def factorable(wrapper: nn.Module, kwargs: dict) -> bool:
        # PEFT folds a single adapter on several experts as its factors (`_activate_lora`); the rest it adds as a delta
        if wrapper.disable_adapters or wrapper.merged or kwargs.get("adapter_names") is not None:
            return False
        return len([a for a in wrapper.active_adapters if a in wrapper.lora_A]) <= 1 and wrapper.num_experts > 1

    @staticmethod
    def factors(wrapper: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
        active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        return wrapper.get_delta_factors(active[0]) if active else None


PARAM_LORA = ParamWrapperLora()


def lora_row_layers(module: nn.Module) -> list[nn.Module]:
    """The LoRA layers inside ``module`` whose forward is ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``
    (PEFT 0.21's ``Linear`` and ``Conv1d``/``Conv2d``/``Conv3d``): those :func:`lora_forward_by_rows` computes."""
    types = _row_layer_types()
    return [layer for layer in module.modules() if isinstance(layer, types)]


def lora_layers(module: nn.Module) -> list[tuple[nn.Module, frozenset[str]]]:
    """Every LoRA layer inside ``module`` (any layer type) with the adapters it holds."""
    found = []
    for layer in module.modules():
        held = set(getattr(layer, "lora_A", {})) | set(getattr(layer, "lora_embedding_A", {}))
        if held and hasattr(layer, "active_adapters"):
            found.append((layer, frozenset(held)))
    return found


def adds_adapters(layer: nn.Module, adapters: frozenset[str]) -> list[str]:
    """Which of ``adapters`` a LoRA layer's forward adds to every row now: its active ones, unless it has them merged
    or disabled."""
    if layer.merged or layer.disable_adapters:
        return []
    return [name for name in layer.active_adapters if name in adapters]


def unmixable_layers(module: nn.Module, adapter: str) -> list[tuple[str, str]]:
    """The layers inside ``module`` where ``adapter`` is a LoRA that :func:`lora_forward_by_rows` cannot compute (an
    embedding, another layer type, a LoRA variant such as DoRA), as ``(layer name, layer class name)``."""
    types = _row_layer_types()
    return [
        (name, type(layer).__name__)
        for name, layer in module.named_modules()
        if adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {})
        if not isinstance(layer, types) or adapter in layer.lora_variant
    ]


def _row_layer_types() -> tuple[type, ...]:
    from peft.tuners.lora import layer

    return (layer.Linear, layer.Conv1d, layer.Conv2d, layer.Conv3d)


def lora_forward_by_rows(
    layer: nn.Module, blocks: Mapping[str, slice], x: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """PEFT's vanilla LoRA forward of one of :func:`lora_row_layers`, with each block of rows of ``x`` (``blocks``:
    adapter name to rows, covering ``x`` in order) through its own adapter; rows whose adapter does not adapt this
    layer get the base layer's output alone. The base layer's matmul runs once over all rows."""
    result = layer.base_layer(x, *args, **kwargs)
    out = []
    for name, rows in blocks.items():
        if name not in layer.lora_A:
            out.append(result[rows])
            continue
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        sub_batch = x[rows]
        if getattr(layer, "cast_input_dtype_enabled", True):  # as PEFT's forward casts (`disable_input_dtype_casting`)
            sub_batch = sub_batch.to(lora_A.weight.dtype)
        out.append(result[rows] + lora_B(lora_A(layer.lora_dropout[name](sub_batch))) * layer.scaling[name])
    return torch.cat(out).to(result.dtype)
