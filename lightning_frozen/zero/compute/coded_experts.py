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
after each expert (Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...), whose fused params no PEFT ``ParamWrapper`` reads (LoRA on
the experts themselves, ``target_parameters``: it adds its delta to the whole param, so that layer is decoded whole as
before). A forward that meets its params parametrized, gathered whole, or under CPU autocast decodes them whole and
runs the class's own forward.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_frozen.capabilities import ROUTED_EXPERTS, available
from lightning_frozen.zero.compute.coded_linear import CodedLayers, CodedMatmul

FUSED = ("gate_up_proj", "down_proj")
# what transformers' `use_experts_implementation` sets on the module: the one layout computed here
LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True}
NO_POST_NORM = "has_post_expert_norm"


def compute_experts_from_codes(
    layers: CodedLayers, model: nn.Module, frozen_dtype_of: Callable[[nn.Parameter], Optional[str]]
) -> int:
    """Make every eligible fused-experts module of ``model`` compute only its routed experts from their gathered codes,
    with the run's ``layers``; return how many.

    Eligible: a module holding ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] in the layout above, both stored
    quantized in CPU memory (``frozen_dtype_of``) and held by it alone, inside no PEFT ``ParamWrapper``. Safe to call
    again. Where transformers' names moved (capability ``ROUTED_EXPERTS``), none: they are decoded whole.
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
        if hasattr(parents.get(id(module)), "parameter_name"):  # PEFT's ParamWrapper adds a delta to the whole param
            continue
        if not available(ROUTED_EXPERTS):
            return done
        if layers.replace_forward(module, functools.partial(_routed_forward, layers, tuple(weights)), weights):
            done += 1
    return done


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
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' eager experts forward, each routed expert computed from its codes (see the module's doc)."""
    gate_up, down = weights
    if (
        parametrize.is_parametrized(self)
        or torch.is_autocast_enabled(hidden_states.device.type)
        or any(layers.held_codes(weight) is None for weight in weights)
    ):
        for weight in weights:
            layers.decode_whole(weight)
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    experts = gate_up.ds_shape[0]
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():  # the experts hit, as the eager forward finds them (index `experts` marks none)
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for expert in hit:
        if expert == experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        projected = CodedMatmul.apply(hidden_states[token_idx], gate_up, layers, expert)
        current = CodedMatmul.apply(self._apply_gate(projected), down, layers, expert)
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states
