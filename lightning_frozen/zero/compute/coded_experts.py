"""A mixture-of-experts layer's fused experts computed from their gathered codes on the CPU, only the experts the
router sends tokens to, each a few rows at a time.

transformers 5 fuses a MoE layer's experts into two params (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), one
ZeRO-3 param each. Decoded whole at each gather, a step decoded every expert of every layer into the compute dtype
twice (forward and backward) and held the layer's decoded experts (E x 3HI values: 0.2 GB in fp32 for 32 experts of
1024 x 512) while it computed, although each token runs top-k of them. Here the gather keeps the codes
(``coded_linear.py``), and the experts' forward runs each expert the router picked for some token through
:class:`~lightning_frozen.zero.compute.coded_linear.CodedMatmul`, its two matrices decoded a tile at a time; backward
does the same for the input's gradient. The rest is transformers' eager forward as it is: the same routing, the
module's own gate (``_apply_gate``), the same weighting and sum.

Only the layout transformers' ``use_experts_implementation`` calls concatenated, untransposed, without bias or a norm
after each expert (Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...). LoRA on the experts themselves (PEFT's ``ParamWrapper``,
``target_parameters``) adds ``scaling * lhs @ rhs`` to the whole fused param, every expert, in each forward; here each
wrapper hands its factors down instead, and a routed expert adds ``x @ rhs[e].T @ lhs[e].T * scaling`` beside its own
matmul (a wrapper with several active adapters, merged or disabled runs PEFT's forward, and the layer decodes whole).
A forward that meets its params parametrized, gathered whole, or under CPU autocast decodes them whole and runs the
class's own forward.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_frozen.capabilities import ROUTED_EXPERTS, available
from lightning_frozen.zero.compute.coded_linear import CodedLayers, CodedMatmul

FUSED = ("gate_up_proj", "down_proj")
# what transformers' `use_experts_implementation` sets on the module: the one layout computed here
LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True}
NO_POST_NORM = "has_post_expert_norm"


class ParamLora(Protocol):
    """LoRA on a param itself (PEFT's ``ParamWrapper``, ``target_parameters``) as the routed experts read it: the hf
    seam's (``hf/peft_adapters.PARAM_LORA``), handed down, since this floor reads no PEFT name."""

    def target(self, module: Optional[nn.Module]) -> Optional[str]:
        """The name of the param ``module`` adds LoRA to, if it is such a wrapper."""

    def wrapped(self, wrapper: nn.Module) -> nn.Module:
        """The module ``wrapper`` wraps."""

    def factorable(self, wrapper: nn.Module, kwargs: dict) -> bool:
        """Whether a forward of ``wrapper`` called with ``kwargs`` adds at most one adapter, as its factors."""

    def factors(self, wrapper: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
        """``(lhs, rhs, scaling)``: the active adapter adds ``scaling * lhs @ rhs`` to the param; None: none does."""


def compute_experts_from_codes(
    layers: CodedLayers,
    model: nn.Module,
    frozen_dtype_of: Callable[[nn.Parameter], Optional[str]],
    param_lora: Optional[ParamLora] = None,
) -> int:
    """Make every eligible fused-experts module of ``model`` compute only its routed experts from their gathered codes,
    with the run's ``layers``; return how many.

    Eligible: a module holding ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] in the layout above, both stored
    quantized in CPU memory (``frozen_dtype_of``) and held by it alone, wrapped by nothing but ``param_lora``'s wrappers
    of those two params (LoRA on the experts: the wrappers' forwards hand their LoRA factors down instead of adding a
    delta to the whole param; without ``param_lora``, not wrapped at all). Safe to call again. Where transformers'
    names moved (capability ``ROUTED_EXPERTS``), none: they are decoded whole.
    """
    uses = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    parents = {id(child): module for module in model.modules() for child in module.children()}
    done = 0
    for module in model.modules():
        weights = [module._parameters.get(name) for name in FUSED]
        if any(weight is None for weight in weights) or not _fused_layout(module, *weights):
            continue
        if any(not layers.eligible(w, frozen_dtype_of(w), uses[id(w)]) for w in weights):
            continue
        wrappers = _lora_wrappers(module, parents, param_lora)
        if wrappers is None or not available(ROUTED_EXPERTS):
            continue
        pending: dict[str, dict] = {}  # the LoRA factors the wrappers hand down, for one forward
        if not layers.replace_forward(
            module, functools.partial(_routed_forward, layers, tuple(weights), pending), weights
        ):
            continue
        for wrapper in wrappers:
            layers.replace_forward(wrapper, functools.partial(_wrapper_forward, param_lora, wrappers, pending), [])
        done += 1
    return done


def _lora_wrappers(
    module: nn.Module, parents: dict[int, nn.Module], param_lora: Optional[ParamLora]
) -> Optional[list[nn.Module]]:
    """The LoRA wrappers of ``param_lora`` around ``module``, outermost first (none: ``[]``), or None where one of
    them targets another param, or where ``module`` is wrapped and there is no ``param_lora`` to read the wrapper."""
    wrappers: list[nn.Module] = []
    parent = parents.get(id(module))
    while param_lora is not None and (target := param_lora.target(parent)) is not None:
        if target not in FUSED:
            return None
        wrappers.insert(0, parent)
        parent = parents.get(id(parent))
    return None if hasattr(parent, "parameter_name") else wrappers  # a wrapper of another kind, or unread


def _wrapper_forward(
    param_lora: ParamLora,
    wrappers: list[nn.Module],
    pending: dict[str, dict],
    self: nn.Module,
    x: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A LoRA wrapper around routed experts: where every wrapper adds at most one adapter, as its factors, each hands
    its factors down and calls the module it wraps (ZeRO-3's hooks so fetch what each holds); else PEFT's forward."""
    if self is wrappers[0]:
        if not all(param_lora.factorable(wrapper, kwargs) for wrapper in wrappers):
            return type(self).forward(self, x, *args, **kwargs)
        pending["factors"] = {}
        try:
            return _hand_down(param_lora, self, pending["factors"], x, *args, **kwargs)
        finally:
            pending.pop("factors", None)
    if "factors" not in pending:
        return type(self).forward(self, x, *args, **kwargs)
    return _hand_down(param_lora, self, pending["factors"], x, *args, **kwargs)


def _hand_down(
    param_lora: ParamLora, wrapper: nn.Module, factors: dict, x: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    found = param_lora.factors(wrapper)
    if found is not None:
        factors[param_lora.target(wrapper)] = found
    return param_lora.wrapped(wrapper)(x, *args, **kwargs)


def _fused_layout(module: nn.Module, gate_up: nn.Parameter, down: nn.Parameter) -> bool:
    shape = getattr(gate_up, "ds_shape", None)
    if shape is None or len(shape) != 3 or shape[1] % 2 or getattr(down, "ds_shape", None) is None:
        return False
    experts, doubled, hidden = shape
    if tuple(down.ds_shape) != (experts, hidden, doubled // 2):
        return False
    layout = all(getattr(module, name, None) is value for name, value in LAYOUT.items())
    return layout and not getattr(module, NO_POST_NORM, True) and callable(getattr(module, "_apply_gate", None))


def _routed_forward(
    layers: CodedLayers,
    weights: tuple[nn.Parameter, nn.Parameter],
    pending: dict[str, dict],
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' eager experts forward, each routed expert computed from its codes, plus the LoRA factors the
    wrappers around it handed down (see the module's doc). Gathered whole (``GatheredParameters``, gather-once
    ``generate``) or under autocast, the same loop over the whole weights, the factors still added; parametrized (PEFT
    added its delta itself), the class's own forward."""
    gate_up, down = weights
    coded = not torch.is_autocast_enabled(hidden_states.device.type)
    coded = coded and all(layers.held_codes(weight) is not None for weight in weights)
    if not coded or parametrize.is_parametrized(self):
        for weight in weights:
            layers.decode_whole(weight)
    if parametrize.is_parametrized(self):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    factors = pending.get("factors", {})
    experts = gate_up.ds_shape[0]
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():  # the experts hit, as the eager forward finds them (index `experts` marks none)
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for expert in hit:
        if expert == experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        current = hidden_states[token_idx]
        projected = _expert_matmul(current, gate_up, expert, factors.get(FUSED[0]), layers if coded else None)
        gated = self._apply_gate(projected)
        current = _expert_matmul(gated, down, expert, factors.get(FUSED[1]), layers if coded else None)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def _expert_matmul(
    input: torch.Tensor, weight: nn.Parameter, expert: int, factors: Optional[tuple], layers: Optional[CodedLayers]
) -> torch.Tensor:
    """``input @ (weight[expert] + scaling * lhs[expert] @ rhs[expert]).T``, the weight from the codes ``layers`` holds
    (None: the weight is whole), the LoRA term (PEFT's factors, if any) as two thin matmuls instead of a delta the size
    of the weight."""
    if layers is None:
        output = input @ weight[expert].transpose(0, 1)
    else:
        output = CodedMatmul.apply(input, weight, layers, expert)
    if factors is None:
        return output
    lhs, rhs, scaling = factors
    return output + (input @ rhs[expert].transpose(0, 1)) @ lhs[expert].transpose(0, 1) * scaling
