"""A mixture-of-experts layer's fused experts computed from their gathered codes on the CPU, only the experts the
router sends tokens to, each a few rows at a time.

transformers 5 fuses a MoE layer's experts into two params (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), one
ZeRO-3 param each. Decoded whole at each gather, a step decoded every expert of every layer into the compute dtype
twice (forward and backward) and held the layer's decoded experts (E x 3HI values: 0.2 GB in fp32 for 32 experts of
1024 x 512) while it computed, although each token runs top-k of them. Here the gather keeps the codes
(``coded_linear.py``), and the experts' forward sorts the (token, expert) pairs by expert once, as transformers'
grouped forward does, and runs each projection as one autograd node over every expert the router picked
(:class:`CodedExpertsMatmul`): each expert's matrix decoded a tile that stays in cache at a time and multiplied by its
rows; backward does the same for the input's gradient. The rest is transformers' as it is: the same routing, the
module's own gate (``_apply_gate``), called once for all the rows, the same weighting and sum.

Only the layout transformers' ``use_experts_implementation`` calls concatenated, untransposed, without bias or a norm
after each expert (Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...). LoRA on the experts themselves (PEFT's ``ParamWrapper``,
``target_parameters``) adds ``scaling * lhs @ rhs`` to the whole fused param, every expert, in each forward; here each
wrapper hands its factors down instead, and a routed expert adds ``x @ rhs[e].T @ lhs[e].T * scaling`` beside its own
matmul (a wrapper with several active adapters, merged or disabled runs PEFT's forward, and the layer decodes whole).
A forward that meets its params gathered whole or under CPU autocast decodes them whole and runs the same, expert by
expert on the whole weights; one that meets them parametrized (PEFT added its delta itself), the class's own forward.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Optional, Protocol

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_frozen.capabilities import ROUTED_EXPERTS, available
from lightning_frozen.zero.compute.coded_linear import CodedLayers

FUSED = ("gate_up_proj", "down_proj")
# what transformers' `use_experts_implementation` sets on the module: the one layout computed here
LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True}
NO_POST_NORM = "has_post_expert_norm"
# an expert's weights decoded at a time (1 MiB in fp32): a few tokens an expert make each tile's matmul short, so the
# tile should stay in L2 while it is read; measured: docs/internals.md, "Tuned constants"
EXPERT_TILE_ELEMENTS = 1 << 18


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
    """transformers' experts forward, each routed expert computed from its codes, plus the LoRA factors the wrappers
    around it handed down (see the module's doc): the (token, expert) pairs sorted by expert once, as transformers'
    grouped forward sorts them, so that each projection is one autograd node over every expert, the module's own gate
    one call, and the weighted sum one ``index_add_``. Gathered whole (``GatheredParameters``, gather-once
    ``generate``) or under autocast, the same over the whole weights, the factors still added; parametrized (PEFT added
    its delta itself), the class's own forward."""
    gate_up, down = weights
    coded = not torch.is_autocast_enabled(hidden_states.device.type)
    coded = coded and all(layers.held_codes(weight) is not None for weight in weights)
    if not coded or parametrize.is_parametrized(self):
        for weight in weights:
            layers.decode_whole(weight)
    if parametrize.is_parametrized(self):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    factors = pending.get("factors", {})
    counts, order = _sorted_by_expert(top_k_index, gate_up.ds_shape[0])
    token = order // top_k_index.shape[-1]
    current = hidden_states[token]
    current = _experts_matmul(current, gate_up, counts, factors.get(FUSED[0]), layers if coded else None)
    current = self._apply_gate(current)
    current = _experts_matmul(current, down, counts, factors.get(FUSED[1]), layers if coded else None)
    current = current * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add_(0, token, current.to(hidden_states.dtype))


def _sorted_by_expert(top_k_index: torch.Tensor, experts: int) -> tuple[list[int], torch.Tensor]:
    """How many (token, expert) pairs each of the ``experts`` gets, and the flat indices into ``top_k_index`` of those
    pairs sorted by expert (an index ``experts`` or above marks none, as expert parallelism marks another rank's)."""
    with torch.no_grad():
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat.clamp(max=experts), minlength=experts + 1)[:experts].tolist()
    return counts, order[: sum(counts)]


def _experts_matmul(
    input: torch.Tensor,
    weight: nn.Parameter,
    counts: list[int],
    factors: Optional[tuple],
    layers: Optional[CodedLayers],
) -> torch.Tensor:
    """``input``'s rows, ``counts[e]`` of them in turn for each expert ``e``, times ``(weight[e] + scaling * lhs[e] @
    rhs[e]).T``: from the codes ``layers`` holds, in one autograd node (:class:`CodedExpertsMatmul`); where the weight
    is whole (``layers`` None), expert by expert, the LoRA term (PEFT's factors, if any) as two thin matmuls instead
    of a delta the size of the weight."""
    if layers is not None:
        lhs, rhs, scaling = factors if factors is not None else (None, None, 0.0)
        return CodedExpertsMatmul.apply(input, weight, layers, counts, lhs, rhs, scaling)
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        rows = input[start : start + count]
        start += count
        if not count:
            continue
        output = rows @ weight[expert].transpose(0, 1)
        if factors is not None:
            lhs, rhs, scaling = factors
            output = output + (rows @ rhs[expert].transpose(0, 1)) @ lhs[expert].transpose(0, 1) * scaling
        outputs.append(output)
    return torch.cat(outputs) if outputs else input.new_empty(0, weight.shape[-2])


class CodedExpertsMatmul(torch.autograd.Function):
    """:func:`_experts_matmul` from the codes: each routed expert's matrix decoded from the codes ``layers`` holds, a
    tile at a time (:meth:`CodedLayers.tiles_of`), and multiplied while in cache; backward decodes it again for the
    input's gradient (the weight is frozen), and computes the LoRA factors' gradients itself."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: nn.Parameter,
        layers: CodedLayers,
        counts: list[int],
        lhs: Optional[torch.Tensor],
        rhs: Optional[torch.Tensor],
        scaling: float,
    ) -> torch.Tensor:
        ctx.weight, ctx.layers, ctx.counts, ctx.scaling = weight, layers, counts, scaling
        ctx.save_for_backward(input if lhs is not None else None, lhs, rhs)
        input = input.contiguous()
        output = input.new_empty(input.shape[0], weight.ds_shape[-2])
        for expert, rows, target in _segments(counts, input, output):
            _coded_rows(layers, weight, expert, rows, target)
            if lhs is not None:
                target.addmm_(rows @ rhs[expert].transpose(0, 1), lhs[expert].transpose(0, 1), alpha=scaling)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        input, lhs, rhs = ctx.saved_tensors
        weight, layers, counts, scaling = ctx.weight, ctx.layers, ctx.counts, ctx.scaling
        wants_input, _, _, _, wants_lhs, wants_rhs, _ = ctx.needs_input_grad
        grad_output = grad_output.contiguous()
        grad_input = grad_output.new_empty(grad_output.shape[0], weight.ds_shape[-1]) if wants_input else None
        grad_lhs = torch.zeros_like(lhs) if wants_lhs else None
        grad_rhs = torch.zeros_like(rhs) if wants_rhs else None
        whole = layers.held_codes(weight) is None  # gathered whole for backward (GatheredParameters around it)
        start = 0
        for expert, grad, target in _segments(counts, grad_output, grad_input):
            rows = None if input is None else input[start : start + len(grad)]
            start += len(grad)
            if target is not None and whole:
                torch.mm(grad, weight[expert], out=target)
            elif target is not None:
                _coded_rows_backward(layers, weight, expert, grad, target)
            if lhs is None:
                continue
            through_lhs = grad @ lhs[expert]  # [rows, rank]
            if target is not None:
                target.addmm_(through_lhs, rhs[expert], alpha=scaling)
            if grad_lhs is not None:
                grad_lhs[expert] = grad.transpose(0, 1) @ (rows @ rhs[expert].transpose(0, 1)) * scaling
            if grad_rhs is not None:
                grad_rhs[expert] = through_lhs.transpose(0, 1) @ rows * scaling
        return grad_input, None, None, None, grad_lhs, grad_rhs, None


def _segments(
    counts: list[int], input: torch.Tensor, output: Optional[torch.Tensor]
) -> Iterator[tuple[int, torch.Tensor, Optional[torch.Tensor]]]:
    """``(expert, its rows of input, the same rows of output)`` for each expert with rows."""
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            yield expert, input[start:end], None if output is None else output[start:end]
            start = end


def _coded_rows(layers: CodedLayers, weight: nn.Parameter, expert: int, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out = rows @ weight[expert].T``, the matrix decoded from its codes a tile of output columns at a time (each
    thread its own tiles, where the compiled kernels can: ``CodedLayers.matmul_from_codes``)."""
    if layers.matmul_from_codes(weight, expert, rows, True, out) is not None:  # the compiled kernels took it
        return
    for first, tile in layers.tiles_of(weight, expert, EXPERT_TILE_ELEMENTS):
        torch.mm(rows, tile.t(), out=out[:, first : first + tile.shape[0]])


def _coded_rows_backward(
    layers: CodedLayers, weight: nn.Parameter, expert: int, grad: torch.Tensor, out: torch.Tensor
) -> None:
    """``out = grad @ weight[expert]``, the matrix decoded from its codes a tile of rows at a time (as
    :func:`_coded_rows`)."""
    if layers.matmul_from_codes(weight, expert, grad, False, out) is not None:
        return
    for first, tile in layers.tiles_of(weight, expert, EXPERT_TILE_ELEMENTS):
        if first == 0:
            torch.mm(grad[:, : tile.shape[0]], tile, out=out)
        else:
            out.addmm_(grad[:, first : first + tile.shape[0]], tile)
