"""Frozen linear layers computed from their gathered codes, a few rows of the weight at a time
(zero/compute/coded_linear.py): the same values as decoding the weight whole, in real fits, and only where nothing else
reads the weight."""

from __future__ import annotations

import ctypes
import functools
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.format import codec, native_codec, partial_decode
from lightning_frozen.zero.compute import coded_linear
from lightning_frozen.zero.params import full_param
from tests.models import AdapterModel, cpu_trainer, regression_data

WIDTH = 64


def _rows(values: torch.Tensor, frozen_dtype: str, ranks: int) -> tuple[torch.Tensor, int]:
    """``values`` as a gather of ``ranks`` shards returns them: one encoded shard a row, padded as ZeRO-3 pads."""
    flat = values.reshape(-1)
    numel = -(-flat.numel() // ranks)
    padded = torch.cat([flat, flat.new_zeros(numel * ranks - flat.numel())])
    return torch.stack([codec.encode(padded[r * numel : (r + 1) * numel], frozen_dtype) for r in range(ranks)]), numel


@pytest.mark.parametrize("frozen_dtype", codec.FROZEN_DTYPES)
def test_part_of_a_gathered_param_decodes_to_those_values_of_the_whole(frozen_dtype: str) -> None:
    generator = random.Random(0)
    for count in (1000, 64 * 37 + 5):  # one not a whole number of blocks: a shard's last block is padded
        rows, numel = _rows(torch.randn(count), frozen_dtype, ranks=2)
        whole = codec.decode(rows, numel, frozen_dtype)
        for _ in range(100):  # any start and length, across the shards' boundary and the blocks'
            start = generator.randrange(2 * numel)
            out = torch.empty(generator.randrange(2 * numel - start + 1))
            assert torch.equal(
                partial_decode.decode_range(rows, numel, frozen_dtype, start, out), whole[start : start + len(out)]
            )
        part = partial_decode.decode_range(rows, numel, frozen_dtype, 17, torch.empty(300, dtype=torch.bfloat16))
        assert torch.equal(part, codec.decode(rows, numel, frozen_dtype, torch.bfloat16)[17:317])
    with pytest.raises(ValueError, match="within the"):
        partial_decode.decode_range(rows, numel, frozen_dtype, 2 * numel - 1, torch.empty(2))


def coded_weight(weight: torch.Tensor, frozen_dtype: str, layers: coded_linear.CodedLayers) -> nn.Parameter:
    """A frozen param as a 2-rank gather for its layer leaves it: codes held in ``layers``, a placeholder as its
    data."""
    param = nn.Parameter(torch.empty(0), requires_grad=False)
    param.ds_shape, param.ds_numel = weight.shape, weight.numel()
    rows, numel = _rows(weight, frozen_dtype, ranks=2)
    param.data = layers.keep_codes(param, rows, numel, frozen_dtype)
    return param


@pytest.mark.parametrize("frozen_dtype", codec.FROZEN_DTYPES)
def test_a_range_decoder_decodes_what_decode_range_does_a_block_aligned_range_in_one_kernel_call(
    frozen_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    generator = random.Random(1)
    rows, numel = _rows(torch.randn(64 * 37 + 5), frozen_dtype, ranks=2)  # each shard's last block padded
    whole = codec.decode(rows, numel, frozen_dtype)
    block = codec.block_format(frozen_dtype).block_size
    decode = partial_decode.range_decoder(rows, numel, frozen_dtype)
    slow = []
    decode_range = partial_decode.decode_range
    monkeypatch.setattr(partial_decode, "decode_range", lambda *a: slow.append(a[3]) or decode_range(*a))
    aligned = [(0, numel), (block, numel - block), (numel, numel), (numel + block, numel - 2 * block), (0, 0)]
    anywhere = [(s, generator.randrange(2 * numel - s + 1)) for s in map(generator.randrange, [2 * numel] * 100)]
    for start, count in aligned + anywhere:
        for dtype in (torch.float32, torch.bfloat16):
            out = decode(start, torch.full((count,), float("nan"), dtype=dtype))
            assert torch.equal(out, whole[start : start + count].to(dtype)), (start, count, dtype)
    fast = codec.block_format(frozen_dtype).cast_dtype is None
    # within a shard and from a block's first weight: one kernel call, decode_range never
    assert not (set(slow) & {start for start, _ in aligned}) if fast else len(slow) == 2 * len(aligned + anywhere)
    assert set(slow) <= {start for start, _ in aligned + anywhere}


@pytest.mark.parametrize("frozen_dtype", ["nf4", "bf16"])
def test_a_layer_computes_from_codes_what_it_computes_from_the_decoded_weight(
    frozen_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tiles of 3 rows of 100 weights: tiles straddle NF4's 64-weight blocks and the two shards
    monkeypatch.setattr(coded_linear, "TILE_ROWS", 3)
    monkeypatch.setattr(coded_linear, "TILE_ELEMENTS", 1)
    layers = coded_linear.CodedLayers()
    weight = torch.randn(37, 100)
    param = coded_weight(weight, frozen_dtype, layers)
    assert torch.isnan(param).all() and param.shape == (37, 100)  # a reader we did not foresee sees NaN
    rows, numel, _ = layers.held_codes(param)
    decoded = codec.decode(rows, numel, frozen_dtype)[: weight.numel()].view_as(weight)
    x = torch.randn(2, 5, 100, requires_grad=True)
    output = coded_linear.CodedMatmul.apply(x, param, layers)
    output.backward(torch.ones_like(output))
    reference_x = x.detach().clone().requires_grad_(True)
    reference = reference_x @ decoded.t()
    reference.backward(torch.ones_like(reference))
    # up to the order of fp32 sums: a narrow matmul may block its sums otherwise, and the input's gradient sums
    # over the tiles in turn
    torch.testing.assert_close(output, reference, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-6, atol=1e-5)
    assert not torch.equal(decoded, weight)  # what was compared is the codes' values, not the source's


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("frozen_dtype", ["nf4", "int8"])
def test_a_matmul_from_codes_on_each_threads_own_tiles_is_the_decoded_weights(
    frozen_dtype: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native_codec.blas_sgemm() is None:
        pytest.skip("torch exports no MKL sgemm here")
    # tiles of 3 rows, 1 block wide (int8's blocks are 256 weights): rows split over several tiles of columns, 2 shards
    # whose boundary falls inside a row, and the last tile of rows short
    monkeypatch.setattr(native_codec, "MATMUL_TILE", (3, 1))
    experts, out_features, in_features = 3, 23, 512
    weight = torch.randn(experts, out_features, in_features)
    rows, numel = _rows(weight, frozen_dtype, ranks=2)
    assert (numel // in_features) * in_features != numel  # the shards' boundary is inside a row
    decoded = codec.decode(rows, numel, frozen_dtype)[: weight.numel()].view_as(weight)
    matmuls = native_codec.CodedMatmuls.of(rows, numel, codec.block_format(frozen_dtype))
    x, grad = torch.randn(7, in_features), torch.randn(7, out_features)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for expert in range(experts):
            offset = expert * out_features * in_features
            assert matmuls.fits(offset, (out_features, in_features), x)
            out = matmuls.forward(offset, (out_features, in_features), x)
            grad_input = matmuls.backward(offset, (out_features, in_features), grad)
            # sums of up to 512 products in another order: up to 4.2e-5 apart over 360 random draws (1e-5 failed one
            # run in two); a tile misplaced or misread is off by about 1
            torch.testing.assert_close(out, x @ decoded[expert].t(), rtol=1e-5, atol=2e-4)
            torch.testing.assert_close(grad_input, grad @ decoded[expert], rtol=1e-5, atol=2e-4)
    finally:
        torch.set_num_threads(previous)
    assert not torch.equal(decoded, weight)  # what was compared is the codes' values, not the source's
    # what the kernel cannot take goes to the row tiles: other dtypes, rows off the blocks, past the shards
    assert not matmuls.fits(0, (out_features, in_features), x.bfloat16())
    assert not matmuls.fits(0, (out_features, 100), torch.randn(7, 100))
    assert not matmuls.fits(32, (out_features, in_features), x)
    assert not matmuls.fits(0, (experts * out_features + 1, in_features), x)
    assert native_codec.CodedMatmuls.of(rows, numel, codec.block_format("bf16")) is None


@pytest.mark.parametrize("frozen_dtype", ["nf4", "int8"])
def test_an_embedding_decodes_only_the_rows_it_looks_up(frozen_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table = torch.randn(50, 64)
    embedding = nn.Embedding(50, 64, padding_idx=0)
    layers = coded_linear.CodedLayers()
    embedding.weight = coded_weight(table, frozen_dtype, layers)
    embedding.forward = functools.partial(coded_linear._FORWARDS[nn.Embedding], layers, embedding)
    rows, numel, _ = layers.held_codes(embedding.weight)
    decoded = codec.decode(rows, numel, frozen_dtype)[: table.numel()].view_as(table)
    decoded_values = []
    decode_range = partial_decode.decode_range

    def counting(*args: Any) -> torch.Tensor:
        decoded_values.append(args[-1].numel())
        return decode_range(*args)

    monkeypatch.setattr(partial_decode, "decode_range", counting)
    ids = torch.tensor([[3, 7, 3, 0], [49, 7, 12, 3]])
    assert torch.equal(embedding(ids), torch.nn.functional.embedding(ids, decoded))
    assert decoded_values == [64] * 5  # the 5 distinct rows, each once
    with pytest.raises(IndexError, match="index out of range"):  # torch's own error, from the whole table
        embedding(torch.tensor([50]))


def test_only_plain_layers_nothing_else_reads_are_computed_from_codes() -> None:
    from peft import LoraConfig, get_peft_model

    class Scaled(nn.Linear):  # a subclass may compute otherwise
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.tied = nn.Linear(8, 10, bias=False)
            self.tied.weight = self.embed.weight  # read whole by the embedding too
            self.plain = nn.Linear(8, 8)
            self.dora = nn.Linear(8, 8)
            self.lora = nn.Linear(8, 8)
            self.subclass = Scaled(8, 8)
            self.vocab = nn.Embedding(10, 8)
            self.rescaled = nn.Embedding(10, 8, max_norm=1.0)  # rescales the rows it looks up, in place

    model = Towers()
    model = get_peft_model(model, LoraConfig(target_modules=["dora"], use_dora=True, r=2))
    model = get_peft_model(model.base_model.model, LoraConfig(target_modules=["lora"], r=2))
    for param in model.parameters():
        param.ds_tensor = torch.empty(1)  # a shard in CPU memory
    stored_as = {id(p): "nf4" for p in model.parameters() if not p.requires_grad}
    layers = coded_linear.CodedLayers()
    assert layers.compute_from_codes(model, lambda p: stored_as.get(id(p))) == 3
    towers = model.base_model.model
    coded = {
        name
        for name, m in towers.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) and layers.computes_from_codes(m.weight)
    }
    assert coded == {"plain", "lora.base_layer", "vocab"}
    assert not coded_linear.CodedLayers().computes_from_codes(towers.plain.weight)  # another run's table is its own
    layers.end_of_run()
    assert "forward" not in vars(towers.plain)


def _fit(
    coded: bool, monkeypatch: pytest.MonkeyPatch, frozen_dtype: str = "nf4"
) -> tuple[AdapterModel, dict, coded_linear.CodedLayers]:
    """A 3-step fit; the model, what was decoded how, and the run's coded layers (its compute object's)."""
    seen: dict[str, Any] = {"whole decodes": 0, "tile decodes": 0, "nan weights": 0, "matmuls from codes": 0}
    decode, range_decoder = codec.decode, partial_decode.range_decoder
    forward, backward = native_codec.CodedMatmuls.forward, native_codec.CodedMatmuls.backward

    def counting(matmul: Any) -> Any:  # a layer's matmul, each thread decoding its own tiles in the kernel
        def counted(*args: Any) -> torch.Tensor:
            seen["matmuls from codes"] += 1
            return matmul(*args)

        return counted

    def counting_decode(stored: torch.Tensor, numel: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen["whole decodes"] += int(stored.reshape(-1, stored.shape[-1]).shape[0] * numel >= WIDTH * WIDTH)
        return decode(stored, numel, *args, **kwargs)

    def counting_decoder(*args: Any) -> Any:  # a layer's tiles, each decoded by its gather's range decoder
        decoder = range_decoder(*args)

        def counted(start: int, out: torch.Tensor) -> torch.Tensor:
            seen["tile decodes"] += 1
            return decoder(start, out)

        return counted

    monkeypatch.setattr(partial_decode, "range_decoder", counting_decoder)
    monkeypatch.setattr(native_codec.CodedMatmuls, "forward", counting(forward))
    monkeypatch.setattr(native_codec.CodedMatmuls, "backward", counting(backward))
    monkeypatch.setattr("lightning_frozen.zero.compute.quantized.decode", counting_decode)
    if not coded:
        monkeypatch.setattr(coded_linear.CodedLayers, "compute_from_codes", lambda self, model, stored_as: 0)
    model = AdapterModel(width=WIDTH, depth=3, optimizer_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))

    def during_forward(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen["nan weights"] += int(bool(torch.isnan(module.weight).all()))

    model.layers[1].base.register_forward_hook(during_forward)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype), max_steps=3, precision="32-true")
    trainer.fit(model, regression_data(width=WIDTH))
    monkeypatch.undo()
    return model, seen, trainer.strategy._compute.tables.layers


@pytest.fixture
def fresh_blas() -> Iterator[None]:
    """``blas_sgemm()`` found and checked again in the test, and again after it."""
    native_codec.blas_sgemm.cache_clear()
    yield
    native_codec.blas_sgemm.cache_clear()


def _an_ilp64_sgemm() -> int:
    """The address of an sgemm that reads 64-bit integers (an ILP64 BLAS): numpy's OpenBLAS; else a visible skip."""
    numpy = pytest.importorskip("numpy")
    for library in sorted(Path(numpy.__file__).parent.parent.glob("numpy.libs/libscipy_openblas64_*.so")):
        return ctypes.cast(ctypes.CDLL(str(library)).scipy_sgemm_64_, ctypes.c_void_p).value
    pytest.skip("numpy brings no ILP64 OpenBLAS here")


@pytest.mark.parametrize("blas", [True, False], ids=["matmuls-from-codes", "row-tiles-beside-an-ILP64-BLAS"])
def test_a_fit_computes_the_frozen_layers_from_codes_and_trains_as_with_whole_weights(
    blas: bool, monkeypatch: pytest.MonkeyPatch, fresh_blas: None
) -> None:
    if blas and native_codec.blas_sgemm() is None:
        pytest.skip("torch exports no MKL sgemm here")
    native_codec.blas_sgemm.cache_clear()  # checked again in the fit, where the layers first multiply
    if not blas:  # torch's sgemm_ would misread the kernels' 32-bit integers: row tiles, multiplied with torch ops
        monkeypatch.setattr(native_codec, "_torch_sgemm", functools.partial(int, _an_ilp64_sgemm()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, seen, layers = _fit(True, monkeypatch)
    fallbacks = [str(w.message) for w in caught if "row tiles" in str(w.message)]
    assert fallbacks == [] if blas else len(fallbacks) == 1 and "64-bit integers" in fallbacks[0], fallbacks
    # after the run the layers compute as their class says again (the tile counts below show they did not in it)
    assert not any(layers.computes_from_codes(layer.base.weight) for layer in model.layers)
    assert not any("forward" in vars(layer.base) for layer in model.layers)
    assert seen["whole decodes"] == 0  # no frozen weight was decoded whole ...
    # ... but from its codes: 3 steps x (3 forwards + 2 backwards: the first layer's input needs no gradient), each
    # a kernel's matmul (its threads decoding their own tiles) or, without MKL, one tile (64 x 64 weights)
    assert seen["matmuls from codes" if blas else "tile decodes"] == 3 * (3 + 2)
    assert seen["tile decodes" if blas else "matmuls from codes"] == 0
    assert seen["nan weights"] == 3  # the layer's data was the placeholder while it computed
    assert not layers._tiles  # the row buffer was given back after the run
    assert all(layers.held_codes(layer.base.weight) is None for layer in model.layers)  # and the codes
    reference, whole, _ = _fit(False, monkeypatch)
    assert whole["whole decodes"] >= 3 * 3 and whole["tile decodes"] == 0 and whole["nan weights"] == 0
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        if param.requires_grad:
            torch.testing.assert_close(full_param(param), full_param(expected), rtol=1e-5, atol=1e-7, msg=name)
    assert not torch.equal(full_param(model.layers[0].lora_b), torch.zeros(WIDTH, 4))
