"""Frozen ``nn.Linear`` and ``nn.Embedding`` layers computed from their gathered codes on the CPU, a part of the
weight at a time: in fp32 with torch's MKL a linear layer's matmul is one call of the compiled kernels, each thread
decoding tiles of its own and multiplying them in its cache (``native_codec.CodedMatmuls``); else it decodes
``TILE_ELEMENTS`` weights (a few output rows) into one small buffer and multiplies them while they are in cache,
forward and backward. An embedding decodes only the rows it looks up. The
gather keeps such a layer's codes (``quantized.py``) and its weight's data is a placeholder that reads as NaN, so a
reader we did not foresee fails loudly. Only a plain layer whose weight no other module shares, outside CPU autocast
and ``GatheredParameters``; why and what it saves: docs/frozen-storage.md.
"""

from __future__ import annotations

import functools
import threading
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.weak import WeakIdKeyDictionary

from lightning_frozen.format import codec, native_codec, partial_decode

# weights decoded at a time (2 MiB in fp32), but at least TILE_ROWS rows; measured: docs/internals.md, "Tuned constants"
TILE_ELEMENTS = 1 << 19
TILE_ROWS = 64


class CodedLayers:
    """One run's layers computed from their codes: which weights (and, while one is gathered, its codes), the layers
    whose ``forward`` the run replaced, and their tile buffers; after :meth:`end_of_run` it computes nothing from
    codes."""

    def __init__(self) -> None:
        self._coded: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._gathered: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a gathered weight's (rows, numel, frozen dtype)
        self._decoders: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a gathered weight's range decoder, once asked
        self._matmuls: WeakIdKeyDictionary = WeakIdKeyDictionary()  # its matmuls from codes (or None), once asked
        self._layers: list[nn.Module] = []
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._tiles: dict[torch.dtype, torch.Tensor] = {}  # one tile buffer per dtype, lent to one matmul at a time
        self._tiles_lock = threading.Lock()  # a forward and a backward on autograd's threads may want one together

    def compute_from_codes(self, model: nn.Module, frozen_dtype_of: Any) -> int:
        """Make every eligible frozen ``nn.Linear`` and ``nn.Embedding`` (no ``max_norm``) of ``model`` compute from its
        gathered codes, return how many: its weight stored quantized in CPU memory (``frozen_dtype_of``), used by no
        other module and not read whole around it (PEFT's DoRA). Safe to call again."""
        uses = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
        parents = {id(child): module for module in model.modules() for child in module.children()}
        done = 0
        for module in model.modules():
            forward = _FORWARDS.get(type(module))
            if forward is None or getattr(module, "max_norm", None) is not None:  # max_norm rescales rows in place
                continue
            weight = module.weight
            if not self.eligible(weight, frozen_dtype_of(weight), uses[id(weight)]):
                continue
            if _reads_weight_whole(parents.get(id(module))):
                continue
            if self.replace_forward(module, functools.partial(forward, self), [weight]):
                done += 1
        return done

    def replace_forward(self, module: nn.Module, forward: Any, weights: list[nn.Parameter]) -> bool:
        """Make ``module`` compute with ``forward`` (called as ``forward(module, *args)``) from the codes of ``weights``
        until :meth:`end_of_run`; return False where a forward of the user's own is on the instance (it may read the
        weights whole) and nothing changed. Safe to call again."""
        if any(layer is module for layer in self._layers):
            return True
        if "forward" in vars(module):
            return False
        for weight in weights:
            self._coded[weight] = True
        module.forward = types.MethodType(forward, module)
        self._layers.append(module)
        return True

    @staticmethod
    def eligible(weight: nn.Parameter, stored_as: Optional[str], uses: int) -> bool:
        """Whether ``weight`` (stored as ``stored_as``, held by ``uses`` modules) can be computed from its codes: stored
        quantized in CPU memory in a format that decodes in parts, and held by one module."""
        if stored_as is None or uses != 1 or weight.ds_tensor.device.type != "cpu":
            return False
        return _decodes_in_parts(stored_as)

    def computes_from_codes(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s layer computes from its codes, so its gather for the layer may keep them undecoded."""
        return param in self._coded

    def keep_codes(self, param: nn.Parameter, rows: torch.Tensor, numel: int, frozen_dtype: str) -> torch.Tensor:
        """Hold ``param``'s gathered codes (``rows``, one encoded shard of ``numel`` values each) for its layer; return
        the placeholder that stands as its data meanwhile: its shape and dtype, every element NaN, no memory of its
        own."""
        self._gathered[param] = (rows, numel, frozen_dtype)
        self._decoders.pop(param, None)
        self._matmuls.pop(param, None)
        base = self._placeholders.get(param.dtype)
        if base is None:
            base = self._placeholders[param.dtype] = torch.full((1,), float("nan"), dtype=param.dtype)
        return base.expand(param.ds_shape)

    def held_codes(self, param: nn.Parameter) -> Optional[tuple[torch.Tensor, int, str]]:
        """The codes :meth:`keep_codes` holds for ``param``, else None."""
        return self._gathered.get(param)

    def drop_codes(self, param: nn.Parameter) -> bool:
        """Let go of the codes held for ``param`` (it is being released); return whether there were any."""
        self._decoders.pop(param, None)
        self._matmuls.pop(param, None)
        return self._gathered.pop(param, None) is not None

    def decode_whole(self, weight: nn.Parameter) -> None:
        """Replace the placeholder by the whole decoded weight where codes are held (``GatheredParameters`` inside a
        forward, autocast); else nothing."""
        held = self.held_codes(weight)
        if held is None:
            return
        rows, numel, frozen_dtype = held
        whole = codec.decode(rows, numel, frozen_dtype, weight.dtype, kernels=native_codec.KERNELS)
        whole = whole[: weight.ds_numel].view(weight.ds_shape)
        self.drop_codes(weight)
        weight.data = whole

    def end_of_run(self) -> None:
        """After a run: the layers compute as their class says again, and the tile buffers go back to the allocator."""
        for layer in self._layers:
            if "forward" in vars(layer):
                del layer.forward
        self._layers.clear()
        self._coded.clear()
        self._gathered.clear()
        self._decoders.clear()
        self._matmuls.clear()
        with self._tiles_lock:
            self._tiles.clear()

    def matmuls_of(self, weight: nn.Parameter) -> Optional[native_codec.CodedMatmuls]:
        """The matmuls straight from ``weight``'s held codes, each thread on tiles of its own, where the compiled
        kernels and torch's BLAS can run them; else None (:meth:`tiles_of` then)."""
        if weight not in self._matmuls:
            rows, numel, frozen_dtype = self.held_codes(weight)
            stored = rows.reshape(-1, rows.shape[-1])
            self._matmuls[weight] = native_codec.CodedMatmuls.of(stored, numel, codec.block_format(frozen_dtype))
        return self._matmuls[weight]

    def matmul_from_codes(
        self,
        weight: nn.Parameter,
        expert: Optional[int],
        values: torch.Tensor,
        forward: bool,
        out: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """``values @ weight.T`` (``forward``) or ``values @ weight`` (2-D ``values``; of ``weight``'s matrix
        ``expert`` where it stacks one per expert), into ``out`` where given, in one call of the compiled kernels
        (:meth:`matmuls_of`); None where they cannot take it (:meth:`tiles_of` then)."""
        matmuls = self.matmuls_of(weight)
        shape = tuple(weight.ds_shape[-2:])
        offset = 0 if expert is None else expert * shape[0] * shape[1]
        if matmuls is None or not matmuls.fits(offset, shape, values) or not (out is None or out.is_contiguous()):
            return None
        return (matmuls.forward if forward else matmuls.backward)(offset, shape, values.contiguous(), out)

    def tiles_of(
        self, weight: nn.Parameter, expert: Optional[int] = None, elements: Optional[int] = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first row, tile)`` for each block of output rows of ``weight`` (of its matrix ``expert`` where it stacks
        one per expert), ``elements`` weights a tile (default :data:`TILE_ELEMENTS`) but at least :data:`TILE_ROWS`
        rows, decoded from its held codes into one buffer lent to this call (another call meanwhile gets one of its
        own): a tile is valid until the next."""
        held = self.held_codes(weight)
        assert held is not None, "a coded layer's weight was not gathered as codes"
        decode = self._decoders.get(weight)
        if decode is None:
            decode = self._decoders[weight] = partial_decode.range_decoder(*held)
        out_features, in_features = weight.ds_shape[-2:]
        offset = 0 if expert is None else expert * out_features * in_features
        per_tile = min(out_features, max(TILE_ROWS, (elements or TILE_ELEMENTS) // in_features))
        with self._tiles_lock:
            buffer = self._tiles.pop(weight.dtype, None)
        if buffer is None or buffer.numel() < per_tile * in_features:
            buffer = torch.empty(per_tile * in_features, dtype=weight.dtype)
        try:
            for first in range(0, out_features, per_tile):
                count = min(per_tile, out_features - first)
                tile = buffer[: count * in_features]
                decode(offset + first * in_features, tile)
                yield first, tile.view(count, in_features)
        finally:
            with self._tiles_lock:
                kept = self._tiles.get(weight.dtype)
                if kept is None or kept.numel() < buffer.numel():
                    self._tiles[weight.dtype] = buffer


def _decodes_in_parts(frozen_dtype: str) -> bool:
    return codec.block_format(frozen_dtype).cast_dtype is not None or native_codec.kernels() is not None


def _reads_weight_whole(parent: Optional[nn.Module]) -> bool:
    use_dora = getattr(parent, "use_dora", None)
    return isinstance(use_dora, dict) and any(use_dora.values())


def _forward(layers: CodedLayers, self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    if layers.held_codes(self.weight) is None or torch.is_autocast_enabled(input.device.type):
        layers.decode_whole(self.weight)
        return F.linear(input, self.weight, self.bias)
    output = CodedMatmul.apply(input, self.weight, layers)
    return output if self.bias is None else output + self.bias


def _embedding_forward(layers: CodedLayers, self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    """The rows ``input`` looks up, each decoded on its own: the frozen table is never decoded whole."""
    held = layers.held_codes(self.weight)
    rows_in_table = self.weight.ds_shape[0]
    if held is not None and input.numel() and not torch.is_autocast_enabled(input.device.type):
        ids, positions = torch.unique(input, return_inverse=True)
        if int(ids[0]) >= 0 and int(ids[-1]) < rows_in_table:  # else F.embedding below raises its own error
            stored, numel, frozen_dtype = held
            width = self.weight.ds_shape[1]
            table = torch.empty(len(ids), width, dtype=self.weight.dtype, device=input.device)
            for row, token in enumerate(ids.tolist()):
                partial_decode.decode_range(stored, numel, frozen_dtype, token * width, table[row])
            return F.embedding(positions, table)  # the table is frozen: padding_idx only ever masks its gradient
    layers.decode_whole(self.weight)
    return F.embedding(
        input, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
    )


_FORWARDS = {nn.Linear: _forward, nn.Embedding: _embedding_forward}


class CodedMatmul(torch.autograd.Function):
    """``input @ weight.T`` (``weight[expert]`` where the weight stacks one matrix per expert) with the weight decoded
    from the codes ``layers`` holds for it, a tile at a time; the gradient flows to ``input`` only (the weight is
    frozen). Backward reads the codes ZeRO-3 gathered again for the layer's backward."""

    @staticmethod
    def forward(
        ctx: Any, input: torch.Tensor, weight: nn.Parameter, layers: CodedLayers, expert: Optional[int] = None
    ) -> torch.Tensor:
        ctx.weight, ctx.layers, ctx.expert = weight, layers, expert
        out_features, in_features = weight.ds_shape[-2:]
        flat = input.reshape(-1, in_features).contiguous()
        output = layers.matmul_from_codes(weight, expert, flat, forward=True)
        if output is not None:
            return output.view(*input.shape[:-1], out_features)
        output = flat.new_empty(flat.shape[0], out_features)
        for first, tile in layers.tiles_of(weight, expert):
            torch.mm(flat, tile.t(), out=output[:, first : first + tile.shape[0]])
        return output.view(*input.shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        weight, layers, expert = ctx.weight, ctx.layers, ctx.expert
        out_features, in_features = weight.ds_shape[-2:]
        grad = grad_output.reshape(-1, out_features)
        if layers.held_codes(weight) is None:  # gathered whole for backward (GatheredParameters around it)
            whole = weight if expert is None else weight[expert]
            return (grad @ whole).view(*grad_output.shape[:-1], in_features), None, None, None
        grad_input = layers.matmul_from_codes(weight, expert, grad, forward=False)
        if grad_input is not None:
            return grad_input.view(*grad_output.shape[:-1], in_features), None, None, None
        grad_input = grad.new_zeros(grad.shape[0], in_features)
        for first, tile in layers.tiles_of(weight, expert):
            grad_input.addmm_(grad[:, first : first + tile.shape[0]], tile)
        return grad_input.view(*grad_output.shape[:-1], in_features), None, None, None
