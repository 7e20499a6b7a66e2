"""Frozen shards stored as int8 / NF4 (``frozen_dtype``): error per block against theory, codes, bytes, fits on 1 and
2 CPU processes, checkpoints that verify against the unquantized base, exact resume, and the errors."""

from __future__ import annotations

import json
import logging
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_frozen
from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.base import fingerprint
from lightning_frozen.checkpoint import trainable_state
from lightning_frozen.errors import FrozenBaseMismatchError, FrozenDtypeError, FrozenTrainingError
from lightning_frozen.format import bitsandbytes_nf4, codec, layout, native_codec
from lightning_frozen.zero import frozen_storage, params
from lightning_frozen.zero.compute import quantized
from tests.distributed import in_a_small_tmpfs, read_reports, run_script
from tests.models import AdapterModel, cpu_trainer, regression_data

WIDTH = 128  # frozen weight 128x128: whole blocks for both formats; the 128-element biases pad their last block
NF4_HALF_GAP = max(b - a for a, b in zip(codec.NF4_VALUES, codec.NF4_VALUES[1:])) / 2
RATIO_LIMIT = {"int8": 0.52, "nf4": 0.28}  # stored bytes / bf16 bytes of the frozen base, from issue 12
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _weights(numel: int = 64 * 256 + 100) -> torch.Tensor:
    """Normal weights whose scale varies across blocks, one all-zero block and one outlier; not a block multiple."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(numel, generator=generator) * torch.logspace(-3, 1, numel)
    values[256:512] = 0.0
    values[1000] = 40.0
    return values


def _blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    padded = math.ceil(values.numel() / block_size) * block_size
    return torch.nn.functional.pad(values, (0, padded - values.numel())).view(-1, block_size)


# ---------------------------------------------------------------------------------------------- encode / decode


def test_int8_error_per_block_is_at_most_absmax_over_254() -> None:
    values = _weights()
    stored = codec.encode(values, "int8")
    error = _blocks(codec.decode(stored, values.numel(), "int8") - values, 256).abs().amax(dim=1)
    absmax = _blocks(values, 256).abs().amax(dim=1)
    _, scales = codec.split(stored, "int8")
    torch.testing.assert_close(scales, absmax)  # fp32 scale: the block's absmax exactly
    assert bool((error <= absmax / 254 * (1 + 1e-6)).all())
    assert float(error[1]) == 0.0  # the all-zero block decodes to zeros
    assert float((error / absmax.clamp_min(1e-30)).max()) > 0.9 / 254  # the bound is tight, not loose


def test_nf4_error_per_block_is_at_most_half_the_largest_code_gap() -> None:
    values = _weights()
    stored = codec.encode(values, "nf4")
    error = _blocks(codec.decode(stored, values.numel(), "nf4") - values, 64).abs().amax(dim=1)
    absmax = _blocks(values, 64).abs().amax(dim=1)
    _, scales = codec.split(stored, "nf4")
    scale = scales.float()
    assert scales.dtype == torch.float16
    assert bool((scale >= absmax).all())  # rounded up: every normalized weight stays in [-1, 1]
    normal = absmax > 2**-14  # fp16 normal range: the rounding adds at most one part in 2**10
    assert bool((scale[normal] <= absmax[normal] * (1 + 2**-10)).all())
    assert bool((error <= NF4_HALF_GAP * scale * (1 + 1e-6)).all())
    assert bool((error <= NF4_HALF_GAP * absmax * (1 + 2**-10) + 1e-7).all())
    assert float(error[4:8].max()) == 0.0  # the all-zero block (elements 256..511) decodes to exact zeros


def test_nf4_has_sixteen_code_values_with_exact_zero_and_decodes_them_exactly() -> None:
    assert len(codec.NF4_VALUES) == 16 and 0.0 in codec.NF4_VALUES
    assert codec.NF4_VALUES[0] == -1.0 and codec.NF4_VALUES[-1] == 1.0
    table = torch.tensor(codec.NF4_VALUES)
    values = table.repeat(8) * 2.0  # 128 weights, absmax 2 (an fp16 value): each is a code value times the scale
    assert torch.equal(codec.decode(codec.encode(values, "nf4"), 128, "nf4"), values)


@pytest.mark.parametrize("frozen_dtype", ["int8", "nf4", "bf16", "fp16"])
def test_codes_round_trip_exactly_and_encoding_is_deterministic(frozen_dtype: str) -> None:
    values = _weights()
    stored = codec.encode(values, frozen_dtype)
    assert stored.dtype == torch.uint8
    assert torch.equal(codec.encode(values.clone(), frozen_dtype), stored)
    decoded = codec.decode(stored, values.numel(), frozen_dtype)
    assert torch.equal(codec.encode(decoded, frozen_dtype), stored)  # decoded values re-encode to the same codes


@pytest.mark.parametrize("frozen_dtype", ["int8", "nf4"])
def test_working_in_chunks_gives_the_same_bytes_and_values(frozen_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    values = _weights()
    whole = codec.encode(values, frozen_dtype)
    decoded = codec.decode(torch.stack([whole, whole]), values.numel(), frozen_dtype, torch.bfloat16)
    monkeypatch.setattr(codec, "_CHUNK_ELEMENTS", 1024)  # 16 chunks instead of one
    assert torch.equal(codec.encode(values, frozen_dtype), whole)
    chunked = codec.decode(torch.stack([whole, whole]), values.numel(), frozen_dtype, torch.bfloat16)
    assert torch.equal(chunked, decoded) and chunked.numel() == 2 * values.numel()


def test_nf4_packs_two_codes_per_byte_high_nibble_first_as_bitsandbytes_does() -> None:
    values = torch.zeros(64)
    values[0], values[1] = -1.0, 1.0  # codes 0 and 15
    codes, _ = codec.split(codec.encode(values, "nf4"), "nf4")
    assert codes.numel() == 32
    assert int(codes[0]) == (0 << 4) | 15
    assert int(codes[1]) == (7 << 4) | 7  # exact zero is code 7
    assert codec.FORMATS["nf4"].describe()["packing"] == "high nibble first"


@pytest.mark.parametrize("frozen_dtype", ["int8", "nf4"])
@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("count", [1100, 3 * 65536 + 7])  # a padded last block, and more than a thread's share
@pytest.mark.parametrize("split", ["openmp", "thread pool"])  # torch's OpenMP threads, or ours where it is missing
def test_compiled_kernels_give_the_tensor_ops_codes_and_values_to_the_bit(
    frozen_dtype: str,
    source_dtype: torch.dtype,
    count: int,
    split: str,
    monkeypatch: pytest.MonkeyPatch,
    two_threads: None,
) -> None:
    lib = native_codec.kernels()
    assert lib is not None, "the CPU kernels did not build: is a C compiler installed?"
    if split == "openmp" and not lib.lf_openmp():
        pytest.skip("the kernels were built without OpenMP (the compiler takes no -fopenmp)")
    values = (_weights(count) * 0.05).to(source_dtype)
    values[:3] = torch.tensor([0.0, -0.0, 1e-30])  # zero, signed zero and a tiny weight share a block
    monkeypatch.setattr(native_codec, "MIN_BLOCKS_PER_THREAD", 4)  # so that even 1100 weights are split
    if split == "thread pool":
        monkeypatch.setattr(lib, "lf_openmp", lambda: 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # three threads split the blocks
    kernels = native_codec.KERNELS
    native = codec.encode(values, frozen_dtype, numel=count + 300, kernels=kernels)
    rows = torch.stack([native, native])
    native_values = {d: codec.decode(rows, count - 5, frozen_dtype, d, kernels=kernels) for d in DTYPES}
    reference = codec.encode(values, frozen_dtype, numel=count + 300)  # no kernels handed in: tensor ops
    assert torch.equal(native, reference)
    for dtype in DTYPES:
        expected = codec.decode(torch.stack([reference, reference]), count - 5, frozen_dtype, dtype)
        assert torch.equal(native_values[dtype], expected), dtype


def test_the_compiled_nf4_encoder_refuses_a_block_beyond_fp16_range() -> None:
    values = torch.zeros(256)
    values[130] = 70000.0
    with pytest.raises(FrozenDtypeError, match="7e\\+04.*frozen_dtype='int8'"):
        codec.encode(values, "nf4", kernels=native_codec.KERNELS)


def test_bitsandbytes_reads_the_nf4_codes_as_they_are_stored() -> None:
    """bitsandbytes decodes on CUDA; its CPU kernel (run here) reads the same layout, so this checks the layout."""
    values = _weights(64 * 100 + 10)
    codes, scales = codec.split(codec.encode(values, "nf4"), "nf4")
    for dtype in DTYPES:
        out = torch.empty(values.numel(), dtype=dtype)
        bitsandbytes_nf4.dequantize(codes, scales, values.numel(), codec.NF4_VALUES, out)
        assert torch.equal(out, codec.decode(codec.encode(values, "nf4"), values.numel(), "nf4", dtype))


def test_without_a_compiler_the_codec_warns_once_and_uses_tensor_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_FROZEN_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(native_codec.shutil, "which", lambda name: None)
    native_codec.kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C compiler.*apt-get install gcc"):
            assert native_codec.kernels() is None
        values = _weights()
        with_tensor_ops = codec.encode(values, "nf4", kernels=native_codec.KERNELS)
        decoded = codec.decode(with_tensor_ops, values.numel(), "nf4", kernels=native_codec.KERNELS)
    finally:
        native_codec.kernels.cache_clear()
    assert not list(tmp_path.iterdir())  # nothing was built
    monkeypatch.undo()
    assert native_codec.kernels() is not None
    assert torch.equal(codec.encode(values, "nf4", kernels=native_codec.KERNELS), with_tensor_ops)
    assert torch.equal(codec.decode(with_tensor_ops, values.numel(), "nf4", kernels=native_codec.KERNELS), decoded)


def test_the_kernels_build_into_the_cache_once_and_leave_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_FROZEN_CACHE", str(tmp_path))
    native_codec.kernels.cache_clear()
    try:
        assert native_codec.kernels() is not None
        built = list(tmp_path.iterdir())
        assert len(built) == 1 and built[0].name.startswith("codec_kernels-") and built[0].suffix == ".so"
        native_codec.kernels.cache_clear()
        assert native_codec.kernels() is not None and list(tmp_path.iterdir()) == built
    finally:
        native_codec.kernels.cache_clear()


def test_stored_bytes_are_within_the_issue_ratios_of_bf16() -> None:
    numel = 4096 * 4096
    assert codec.storage_bytes(numel, "int8", 2) / (2 * numel) == pytest.approx(1.015625 / 2)
    assert codec.storage_bytes(numel, "nf4", 2) / (2 * numel) == pytest.approx(0.53125 / 2)
    for frozen_dtype, limit in RATIO_LIMIT.items():
        assert codec.encode(torch.randn(numel // 64), frozen_dtype).numel() <= limit * 2 * numel // 64
    assert codec.storage_bytes(100, None, 2) == 200
    assert codec.storage_bytes(100, "bf16", 4) == codec.storage_bytes(100, "fp16", 4) == 200


def test_estimate_memory_counts_quantized_frozen_shards() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2))
    model[0].requires_grad_(False)  # 65,792 frozen elements
    estimates = {
        dtype: lightning_frozen.estimate_memory(
            model, num_devices=2, precision="bf16-mixed", frozen_dtype=dtype, print_table=False
        )
        for dtype in (None, "int8", "nf4")
    }
    assert estimates[None].frozen_shards == 32896 * 2
    assert estimates["int8"].frozen_shards == 129 * (256 + 4)  # ceil(32,896 / 256) blocks of codes + fp32 scale
    assert estimates["nf4"].frozen_shards == 514 * (32 + 2)  # 514 blocks of 64: 32 code bytes + fp16 scale
    assert estimates["nf4"].host_bytes == estimates[None].host_bytes - (32896 * 2 - 514 * 34)
    assert estimates["int8"].trainable_weights == estimates[None].trainable_weights
    with pytest.raises(FrozenDtypeError, match="`frozen_dtype='fp8'` is not a frozen storage dtype"):
        lightning_frozen.estimate_memory(model, frozen_dtype="fp8")


# ---------------------------------------------------------------------------------------------- errors


def test_unknown_frozen_dtype_is_refused_at_construction() -> None:
    with pytest.raises(FrozenDtypeError, match=r"`frozen_dtype='int4'`.*'int8'.*'nf4'.*'bf16'.*'fp16'.*None") as raised:
        FrozenAwareDeepSpeedStrategy(frozen_dtype="int4")
    assert isinstance(raised.value, FrozenTrainingError) and isinstance(raised.value, ValueError)


def test_quantizing_a_trainable_param_is_refused() -> None:
    param = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(FrozenDtypeError, match=r"trainable param \(shape \(8, 8\)\) cannot be stored as nf4.*Freeze"):
        quantized.quantize_param_shard(param, "nf4", quantized.RunTables())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs an accelerator that cannot run the dequantization")
def test_an_accelerator_that_cannot_run_the_dtype_is_named() -> None:
    # a CPU-only torch build has no CUDA: the probe fails there as it would on an accelerator without the ops
    with pytest.raises(FrozenDtypeError, match=r"`frozen_dtype='nf4'` cannot dequantize to torch.bfloat16 on `cuda"):
        frozen_storage.check_runs_on("nf4", torch.device("cuda", 0), torch.bfloat16)
    frozen_storage.check_runs_on("nf4", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize(
    ("zero_config", "message"),
    [
        ({"stage": 2}, "ZeRO stage 2 is configured"),
        ({"stage": 3, "zero_quantized_nontrainable_weights": True}, "both quantize the frozen shards"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "NVMe parameter offload"),
    ],
)
def test_configs_that_cannot_hold_quantized_shards_are_refused(zero_config: dict, message: str) -> None:
    with pytest.raises(FrozenDtypeError, match=message):
        frozen_storage.check_config("int8", {"zero_optimization": zero_config}, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- 1 process


def _expected_weight(source: torch.Tensor, frozen_dtype: str, world_size: int) -> torch.Tensor:
    """What a layer computes with: each rank's ZeRO-3 shard of ``source`` encoded on its own, decoded to bf16."""
    flat = source.reshape(-1)
    shard = math.ceil(flat.numel() / world_size)
    pieces = [
        codec.decode(codec.encode(flat[r * shard : (r + 1) * shard], frozen_dtype, numel=shard), shard, frozen_dtype)
        for r in range(world_size)
    ]
    return torch.cat(pieces)[: flat.numel()].to(torch.bfloat16).view_as(source)


def _fit_quantized(
    frozen_dtype: str, max_epochs: int = 1, resume: Path | None = None, watch: bool = True, **strategy_kwargs: Any
) -> tuple[AdapterModel, Any, dict[str, torch.Tensor]]:
    """A fit; with ``watch``, the first weight the first layer's forward saw in ``seen["weight"]``, read by a pre-hook.
    Over an nf4 base the step it first reads the weight in is not bit-identical to an unwatched one (another compute
    path, it seems), so that runs compared bit for bit are either all watched from their first step or none."""
    model = AdapterModel(width=WIDTH)
    seen: dict[str, torch.Tensor] = {}

    def keep_first_weight(module: torch.nn.Module, inputs: tuple) -> None:
        seen.setdefault("weight", module.weight.detach().clone())

    if watch:
        model.layers[0].base.register_forward_pre_hook(keep_first_weight)
    strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype, **strategy_kwargs)
    trainer = cpu_trainer(strategy, max_epochs=max_epochs, precision="bf16-true")
    trainer.fit(model, regression_data(width=WIDTH), ckpt_path=resume)
    return model, trainer, seen


@pytest.mark.parametrize("frozen_dtype", ["int8", "nf4"])
def test_one_process_fit_stores_codes_and_computes_with_dequantized_bf16(
    frozen_dtype: str, tmp_path: Path, lightning_log: Any
) -> None:
    source = AdapterModel(width=WIDTH).to(torch.bfloat16)
    model, trainer, seen = _fit_quantized(frozen_dtype)

    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    stored = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in frozen.values())
    bf16 = sum(int(p.ds_numel) * 2 for p in frozen.values())
    assert {p.ds_tensor.dtype for p in frozen.values()} == {torch.uint8}
    assert {p.ds_tensor.device.type for p in frozen.values()} == {"cpu"}
    assert stored == sum(codec.storage_bytes(int(p.ds_numel), frozen_dtype, 2) for p in frozen.values())
    assert stored / bf16 <= RATIO_LIMIT[frozen_dtype]
    assert f"frozen shards {lightning_frozen.memory.format_bytes(stored)} ({frozen_dtype}) in cpu memory" in (
        lightning_log.text
    )
    # built in `__init__`: quantized only at setup, and the summary says what that cost
    assert f"stored as {frozen_dtype} only at setup: until then the node held them in the compute dtype" in (
        lightning_log.text
    )
    # the layer's forward saw the dequantized weight, whole and in the compute dtype
    assert seen["weight"].dtype == torch.bfloat16 and seen["weight"].shape == (WIDTH, WIDTH)
    assert torch.equal(seen["weight"], _expected_weight(source.layers[0].base.weight, frozen_dtype, 1))
    # a gather outside forward (GatheredParameters) decodes the same, then the shard is released again
    whole = params.full_param(model.layers[0].base.weight)
    assert torch.equal(whole, seen["weight"]) and model.layers[0].base.weight.numel() == 0
    # the adapter trained
    assert not torch.equal(model.layers[0].lora_b.ds_tensor, torch.zeros_like(model.layers[0].lora_b.ds_tensor))

    path = tmp_path / "adapter.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    quantization = saved["frozen_base"]["quantization"]
    assert quantization["dtype"] == frozen_dtype
    assert quantization["block_size"] == {"int8": 256, "nf4": 64}[frozen_dtype]
    # the fingerprint is of the source weights: the unquantized base, in bf16 or fp32, verifies against it
    source_frozen = [(n, p) for n, p in source.named_parameters() if not p.requires_grad]
    assert saved["frozen_base"]["fingerprint"]["digest"] == fingerprint.fingerprint_base(source_frozen)["digest"]
    reloaded = lightning_frozen.load_adapter(AdapterModel(width=WIDTH), path)
    for name, value in saved["state_dict"].items():
        torch.testing.assert_close(dict(reloaded.named_parameters())[name].detach(), value)
    with pytest.raises(FrozenBaseMismatchError, match="tests/adapter-model"):
        lightning_frozen.load_adapter(AdapterModel(width=WIDTH, seed=1), path)


def _assert_goes_on_as_the_straight_run(resumed: Path, straight: Path, steps: int) -> None:
    """The checkpoint ``resumed`` wrote after resuming matches that of the run that never stopped: the trainable
    weights and the optimizer's moments it restored went on from where the first run left them. (A fresh encoding
    reproduces the quantized base: the checkpoint holds no codes, so comparing them tells nothing of the resume.)"""
    ours, theirs = torch.load(resumed, weights_only=True), torch.load(straight, weights_only=True)
    assert ours["global_step"] == theirs["global_step"] == steps
    assert ours["state_dict"] and ours["state_dict"].keys() == theirs["state_dict"].keys()
    state, straight_state = ours["optimizer_states"][0]["state"], theirs["optimizer_states"][0]["state"]
    for name, value in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][name], value), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][moment], straight_state[name][moment]), (name, moment)


def test_resume_goes_on_as_the_straight_run_over_the_quantized_base(tmp_path: Path, lightning_log: Any) -> None:
    _, trainer, _ = _fit_quantized("nf4", watch=False)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    _, trainer, _ = _fit_quantized("nf4", max_epochs=2, resume=tmp_path / "one.ckpt", watch=False)
    trainer.save_checkpoint(tmp_path / "resumed.ckpt")
    _, trainer, _ = _fit_quantized("nf4", max_epochs=2, watch=False)
    trainer.save_checkpoint(tmp_path / "straight.ckpt")
    _assert_goes_on_as_the_straight_run(tmp_path / "resumed.ckpt", tmp_path / "straight.ckpt", steps=16)
    assert "trained on a frozen base stored as" not in lightning_log.text


def test_resume_onto_another_storage_warns_and_verifies_the_same_base(tmp_path: Path) -> None:
    _, trainer, _ = _fit_quantized("int8")
    path = tmp_path / "int8.ckpt"
    trainer.save_checkpoint(path)
    with pytest.warns(UserWarning, match="stored as int8, this run stores it as nf4"):
        _, trainer, _ = _fit_quantized("nf4", max_epochs=2, resume=path)
    assert trainer.global_step == 16


def test_sha256_fingerprint_is_of_the_source_bytes(tmp_path: Path) -> None:
    source = AdapterModel(width=WIDTH).to(torch.bfloat16)
    _, trainer, _ = _fit_quantized("int8", fingerprint="sha256")
    path = tmp_path / "sha.ckpt"
    trainer.save_checkpoint(path)
    recorded = torch.load(path, weights_only=True)["frozen_base"]["fingerprint"]
    source_frozen = [(n, p) for n, p in source.named_parameters() if not p.requires_grad]
    assert recorded["digest"] == fingerprint.fingerprint_base(source_frozen, "sha256")["digest"]


def test_writing_a_quantized_param_requantizes_it_and_it_cannot_be_made_trainable(tmp_path: Path) -> None:
    import deepspeed

    source = AdapterModel(width=WIDTH).to(torch.bfloat16).layers[0].base.weight.detach()
    model, trainer, _ = _fit_quantized("int8", fingerprint="sha256")
    weight = model.layers[0].base.weight

    def recorded_value(name: str) -> str:  # what a checkpoint written now records for the weight
        trainer.save_checkpoint(tmp_path / name)
        tensors = torch.load(tmp_path / name, weights_only=True)["frozen_base"]["fingerprint"]["tensors"]
        return tensors["layers.0.base.weight"]["value"]

    assert recorded_value("source.ckpt") == fingerprint.tensor_sha256(source)  # of the source, not of the codes
    before = params.full_param(weight)
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        weight.data.mul_(-2)
    expected = codec.decode(codec.encode(before.float() * -2, "int8"), weight.ds_numel, "int8", torch.bfloat16)
    assert weight.ds_tensor.dtype == torch.uint8
    assert torch.equal(params.full_param(weight), expected.view(WIDTH, WIDTH))
    # a checkpoint now names the written values, in both modes (sha256 once kept the old values' hash)
    assert recorded_value("written.ckpt") == fingerprint.tensor_sha256(before * -2)
    written = [("layers.0.base.weight", before * -2)]
    checksum = trainer.strategy.frozen_base_fingerprint([("layers.0.base.weight", weight)], "checksum")
    assert checksum["tensors"] == fingerprint.fingerprint_base(written, "checksum")["tensors"]

    weight.requires_grad_(True)
    with pytest.raises(FrozenDtypeError, match=r"`layers.0.base.weight` is stored quantized.*cannot be trained"):
        quantized.quantize_frozen_shards(model, "int8", quantized.RunTables())


def test_frozen_dtype_comes_from_yaml_and_the_command_line(tmp_path: Path) -> None:
    import warnings

    import yaml

    from lightning_frozen.cli import lightning_cli

    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "precision": "bf16-true",
            "max_steps": 2,
            "default_root_dir": str(tmp_path / "yaml"),
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": {
                "class_path": "lightning_frozen.FrozenAwareDeepSpeedStrategy",
                "init_args": {"frozen_dtype": "nf4"},
            },
        },
        "model": {"class_path": "tests.cli_support.SavedHparamsAdapterModel", "init_args": {"width": WIDTH}},
        "data": {"class_path": "tests.cli_support.RegressionData", "init_args": {"width": WIDTH}},
    }
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        from_yaml = lightning_cli(["fit", "--config", str(path)])
        assert from_yaml.trainer.strategy.frozen_dtype == "nf4"
        assert from_yaml.model.layers[0].base.weight.ds_tensor.dtype == torch.uint8
        overridden = lightning_cli(
            [
                "fit",
                "--config",
                str(path),
                "--trainer.strategy.init_args.frozen_dtype=int8",
                f"--trainer.default_root_dir={tmp_path / 'cli'}",
            ]
        )
        assert overridden.trainer.strategy.frozen_dtype == "int8"
        with pytest.raises(SystemExit):
            lightning_cli(["fit", "--config", str(path), "--trainer.strategy.init_args.frozen_dtype=int4"])


@pytest.mark.parametrize("frozen_dtype", ["bf16", "fp16"])
def test_fp32_training_over_a_half_precision_base_is_fp32_training_over_the_rounded_base(frozen_dtype: str) -> None:
    """The same updates as over an fp32 base holding the rounded values, up to the order of fp32 sums: the linear
    layers' input gradient sums over a few rows of the weight at a time (``zero/compute/coded_linear.py``). Plain
    SGD, so that a rounding-sized difference stays rounding-sized (Adam's first steps turn it into the sign of a
    near-zero gradient)."""
    cast = codec.FORMATS[frozen_dtype].cast_dtype
    runs = {}
    for storage in (frozen_dtype, None):
        model = AdapterModel(width=WIDTH, optimizer_fn=lambda module: torch.optim.SGD(module.parameters(), lr=0.1))
        if storage is None:  # the reference: an fp32 base whose values were rounded to the half dtype
            for param in model.parameters():
                if not param.requires_grad:
                    param.data = param.data.to(cast).float()
        trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(frozen_dtype=storage), precision="32-true")
        trainer.fit(model, regression_data(width=WIDTH))
        runs[storage] = model
    stored, reference, initial = runs[frozen_dtype], runs[None], AdapterModel(width=WIDTH)
    frozen = [p for p in stored.parameters() if not p.requires_grad]
    assert {p.ds_tensor.dtype for p in frozen} == {torch.uint8}
    assert all(p.ds_tensor.numel() * p.ds_tensor.element_size() == 2 * p.ds_numel for p in frozen)  # 2 B a weight
    trained = [(n, p) for n, p in stored.named_parameters() if p.requires_grad]
    starts = (p for p in initial.parameters() if p.requires_grad)
    for (name, param), expected, start in zip(trained, (p for p in reference.parameters() if p.requires_grad), starts):
        update, expected_update = params.full_param(param) - start, params.full_param(expected) - start
        torch.testing.assert_close(update, expected_update, rtol=1e-4, atol=1e-8, msg=name)
    assert not torch.equal(params.full_param(stored.layers[0].lora_b), torch.zeros(WIDTH, 4))


def test_fp16_storage_refuses_weights_beyond_its_range() -> None:
    with pytest.raises(FrozenDtypeError, match=r"magnitude 7e\+04, beyond fp16's range.*`frozen_dtype='bf16'`"):
        codec.encode(torch.tensor([1.0, -70000.0]), "fp16")


# ---------------------------------------------------------------------------------------------- 2 processes


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nf4 and int8 fits on 2 ranks, each saved, then nf4 resumed on 2 ranks for a second epoch; then, in the same
    world (the file's only one), the fits of ``prefetched`` into ``prefetch/``. Where this machine can mount one, the
    world runs where ``small-shm/`` is a tmpfs of 16 KiB, too small for the codes (about 40 KiB)."""
    tmp = tmp_path_factory.mktemp("quant_two_ranks")
    small_shm = tmp / "small-shm"
    small_shm.mkdir()
    prefix = in_a_small_tmpfs(small_shm, "16k")
    run_script(
        "train_quantized.py",
        *("--frozen-dtypes", "nf4", "int8", f"--out={tmp}", f"--prefetch-out={tmp / 'prefetch'}"),
        *([f"--small-shm={small_shm}"] if prefix else []),
        prefix=prefix or (),
    )
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("frozen_dtype", ["int8", "nf4"])
def test_two_process_fit_holds_half_the_codes_per_rank(two_ranks: Path, frozen_dtype: str) -> None:
    reports = read_reports(two_ranks / frozen_dtype)
    assert [r["rank"] for r in reports] == [0, 1] and all(r["world_size"] == 2 for r in reports)
    source = AdapterModel(width=WIDTH).to(torch.bfloat16)
    expected = _expected_weight(source.layers[0].base.weight, frozen_dtype, 2).float()
    for report in reports:
        assert report["frozen_shard_dtypes"] == ["torch.uint8"]
        bf16_per_rank = report["frozen_numel"] // 2 * 2
        assert report["frozen_shard_bytes"] / bf16_per_rank <= RATIO_LIMIT[frozen_dtype]
        # both ranks computed with the same dequantized weight, decoded from the two ranks' codes
        assert report["seen_dtype"] == "torch.bfloat16"
        assert torch.equal(torch.tensor(report["seen_weight"]), expected)


@pytest.mark.slow
def test_two_process_resume_goes_on_as_the_straight_run_and_records_the_quantization(two_ranks: Path) -> None:
    first, resumed = read_reports(two_ranks / "nf4"), read_reports(two_ranks / "resumed")
    assert [r["global_step"] for r in resumed] == [8, 8]
    _assert_goes_on_as_the_straight_run(two_ranks / "resumed.ckpt", two_ranks / "straight.ckpt", steps=8)
    assert len(first) == 2 and first[0]["codes_sha256"] != first[1]["codes_sha256"]  # each rank holds its own half
    saved = torch.load(two_ranks / "nf4.ckpt", weights_only=True)
    assert saved["frozen_base"]["quantization"]["dtype"] == "nf4"
    assert json.dumps(saved["frozen_base"]["quantization"])  # plain types only


@pytest.mark.parametrize(
    ("frozen_dtype", "precision"), [("int8", "bf16-mixed"), ("nf4", "bf16-mixed"), ("bf16", "32-true")]
)
def test_a_quantized_llama_from_configure_model_trains_and_validates(
    frozen_dtype: str, precision: str, tmp_path: Path
) -> None:
    # a Hugging Face model makes DeepSpeed prefetch several quantized params in one gather (embedding and lm_head
    # share a size); each param's handle is then waited on separately, after the others may have been released.
    # bf16 storage under fp32 compute: the bf16 checkpoint's values, decoded to fp32, are what an fp32 base holds
    from tests.pretrained_support import PretrainedLoRA, token_data, write_llama

    folder = write_llama(tmp_path / "llama")
    losses = {}
    for storage in (None, frozen_dtype):
        trainer = cpu_trainer(
            FrozenAwareDeepSpeedStrategy(frozen_dtype=storage),
            max_steps=4,
            max_epochs=-1,
            precision=precision,
            limit_val_batches=1,
        )
        torch.manual_seed(0)  # the same LoRA initialisation in both runs
        module = PretrainedLoRA(str(folder))
        trainer.fit(module, token_data(), token_data())
        losses[storage] = float(trainer.callback_metrics["val_loss"])
        frozen = [p for p in module.parameters() if not p.requires_grad]
        stored_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in frozen)
    assert math.isfinite(losses[frozen_dtype])
    assert abs(losses[frozen_dtype] - losses[None]) < 0.1 * losses[None], losses
    if frozen_dtype == "bf16":
        assert losses[frozen_dtype] == losses[None]
        assert stored_bytes == 2 * sum(int(p.ds_numel) for p in frozen)


@pytest.fixture(scope="module")
def prefetched(two_ranks: Path) -> Path:
    """NF4 fits on 2 ranks: reading each other's codes from shared memory (``shared``); then exchanging them through
    the process group with the asynchronous quantized gather (``async``), and with gathers that wait inside the
    call (``sync``)."""
    return two_ranks / "prefetch"


@pytest.mark.slow
def test_ranks_on_one_machine_read_each_others_codes_from_shared_memory(prefetched: Path) -> None:
    shared, exchanged = read_reports(prefetched / "shared"), read_reports(prefetched / "async")
    assert len(shared) == len(exchanged) == 2
    for fast, slow in zip(shared, exchanged):
        assert fast["shared_params"] == fast["frozen_params"] > 0 and slow["shared_params"] == 0
        assert fast["shards_are_their_rows"] and all(fast["shards_are_their_rows"])
        assert not [g for g in fast["gathers"] if g["dtype"] == "torch.uint8"]  # no codes crossed the process group
        assert [g for g in slow["gathers"] if g["dtype"] == "torch.uint8"]  # (the recorder sees them when they do)
        assert fast["global_step"] == slow["global_step"] == 4
        assert fast["trainable"] == slow["trainable"]  # the same codes decoded: bit-identical training
        assert fast["own_files_left"] == slow["own_files_left"] == []  # unlinked once every rank mapped it
        assert fast["exchange_warnings"] == []
    # ranks that cannot open rank 0's file (another machine's /dev/shm) exchange codes, and rank 0 says why once
    assert exchanged[1]["exchange_warnings"] == []
    (why,) = exchanged[0]["exchange_warnings"]
    assert "not every rank could open it" in why


@pytest.mark.slow
def test_a_shared_folder_without_room_for_the_codes_falls_back_to_the_process_group(prefetched: Path) -> None:
    if not (prefetched / "small-shm").exists():
        pytest.skip("this machine mounts no tmpfs in a namespace of its own (`unshare -rm` refused)")
    small, shared = read_reports(prefetched / "small-shm"), read_reports(prefetched / "shared")
    assert len(small) == len(shared) == 2
    for cramped, roomy in zip(small, shared):  # both ranks alive: no SIGBUS at a write into the full tmpfs
        assert cramped["shared_params"] == 0 and cramped["frozen_params"] > 0
        assert [g for g in cramped["gathers"] if g["dtype"] == "torch.uint8"]  # codes crossed the process group
        assert cramped["global_step"] == roomy["global_step"] == 4
        assert cramped["trainable"] == roomy["trainable"]  # the same training as with the codes shared
    assert small[1]["exchange_warnings"] == []
    (why,) = small[0]["exchange_warnings"]  # one line, on rank 0
    pattern = r"small-shm has [\d.]+ GiB free and the codes take [\d.]+ GiB \(No space left on device; in a container"
    assert re.search(pattern, why) and "\n" not in why, why


@pytest.mark.slow
def test_where_dev_shm_has_no_room_the_ranks_share_the_codes_in_the_code_cache_s_folder(prefetched: Path) -> None:
    if not (prefetched / "spilled").exists():
        pytest.skip("this machine mounts no tmpfs in a namespace of its own (`unshare -rm` refused)")
    spilled, shared = read_reports(prefetched / "spilled"), read_reports(prefetched / "shared")
    assert len(spilled) == len(shared) == 2
    for on_disk, in_memory in zip(spilled, shared):
        assert on_disk["shared_params"] == on_disk["frozen_params"] > 0 and on_disk["exchange_warnings"] == []
        assert not [g for g in on_disk["gathers"] if g["dtype"] == "torch.uint8"]  # no codes crossed the group
        assert on_disk["trainable"] == in_memory["trainable"]
    assert not list((prefetched / "spill").glob("lightning-frozen-*"))  # unlinked once every rank mapped it


@pytest.mark.slow
def test_the_next_run_removes_files_of_dead_jobs_of_its_user_and_no_other(prefetched: Path) -> None:
    if not (prefetched / "small-shm").exists():
        pytest.skip("this machine mounts no tmpfs in a namespace of its own (`unshare -rm` refused)")
    planted = json.loads((prefetched / "small-shm-planted.json").read_text())
    kept = sorted(name for kind, name in planted.items() if kind != "dead")
    assert len(kept) >= 2  # a live job's, another user's (and, as root, one owned by another user)
    reports = read_reports(prefetched / "small-shm")
    assert len(reports) == 2
    for report in reports:
        assert report["shared_files_left"] == kept


@pytest.mark.slow
def test_a_handshake_that_raises_leaves_no_shared_file_and_no_mapping(prefetched: Path) -> None:
    reports = read_reports(prefetched / "raising-handshake")
    assert len(reports) == 2
    assert len(reports[0]["files_at_the_raise"]) == 1  # rank 0 had made the file when the process group failed
    for report in reports:
        assert report["raised"] == "a rank died"  # the error reaches the caller
        assert report["files_left"] == []
        assert report["mapped_after"] == []  # unmapped as the error left `share_codes`
        assert report["shared_params"] == 0


@pytest.mark.slow
def test_prefetched_quantized_gathers_stay_in_flight_while_other_layers_compute(prefetched: Path) -> None:
    asynchronous, synchronous = read_reports(prefetched / "async"), read_reports(prefetched / "sync")
    assert len(asynchronous) == len(synchronous) == 2
    for report in asynchronous:
        codes = [g for g in report["gathers"] if g["dtype"] == "torch.uint8"]  # the quantized gathers' collectives
        assert codes and all(g["async_op"] for g in codes)
        assert all(g["waited_at"] is not None for g in codes)  # every collective's work is waited on, in `wait`
        # the coordinator prefetched them: frozen layers' forwards ran between starting a gather and waiting on it
        in_flight = [g["waited_at"] - g["started_at"] for g in codes]
        assert sum(1 for n in in_flight if n > 0) >= len(codes) // 4, in_flight
    for report in synchronous:
        codes = [g for g in report["gathers"] if g["dtype"] == "torch.uint8"]
        assert codes and all(g["waited_at"] == g["started_at"] for g in codes)  # the check can tell the two apart


@pytest.mark.slow
def test_the_asynchronous_gather_trains_exactly_as_the_synchronous_one(prefetched: Path) -> None:
    asynchronous, synchronous = read_reports(prefetched / "async"), read_reports(prefetched / "sync")
    source = AdapterModel(width=WIDTH, depth=4).to(torch.bfloat16)
    weight, bias = (_expected_weight(p, "nf4", 2) for p in (source.layers[3].base.weight, source.layers[3].base.bias))
    assert len(asynchronous) == len(synchronous) == 2
    for fast, slow in zip(asynchronous, synchronous):
        assert fast["global_step"] == slow["global_step"] == 4
        assert fast["trainable"] == slow["trainable"]  # bit-identical adapters and head after 4 steps
        # the last step's layer computed with the decoded base (from its codes, a few rows at a time)
        seen_input = torch.tensor(fast["seen_input"], dtype=torch.bfloat16)
        expected = torch.nn.functional.linear(seen_input, weight, bias).float()
        torch.testing.assert_close(torch.tensor(fast["seen_output"]), expected, rtol=1e-2, atol=1e-3)
    assert asynchronous[0]["trainable"] == asynchronous[1]["trainable"]


def _checkpoint_stored_as(quantization: dict[str, Any]) -> dict[str, Any]:
    return {layout.FROZEN_BASE: {layout.QUANTIZATION: quantization}}


def test_a_checkpoint_of_the_older_nf4_layout_resumes_with_a_one_line_notice(caplog: pytest.LogCaptureFixture) -> None:
    older = codec.FORMATS["nf4"].describe()
    del older[layout.PACKING]  # 0.1.0 packed the low nibble first and did not record it
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("error")  # a notice, not a warning: the weights are the same
        trainable_state.warn_if_stored_otherwise(_checkpoint_stored_as(older), "nf4", "old.ckpt")
    notices = [r.getMessage() for r in caplog.records if "old.ckpt" in r.getMessage()]
    assert len(notices) == 1 and "low nibble first" in notices[0] and "high nibble first" in notices[0]
    caplog.clear()
    current = _checkpoint_stored_as(codec.FORMATS["nf4"].describe())
    trainable_state.warn_if_stored_otherwise(current, "nf4", "new.ckpt")
    assert not [r for r in caplog.records if "new.ckpt" in r.getMessage()]


def test_a_checkpoint_of_another_block_size_warns_that_the_base_differs() -> None:
    other = {**codec.FORMATS["nf4"].describe(), layout.BLOCK_SIZE: 128}
    with pytest.warns(UserWarning, match="other block_size \\(128\\) than this version \\(64\\)"):
        trainable_state.warn_if_stored_otherwise(_checkpoint_stored_as(other), "nf4", "other.ckpt")


def test_decode_into_a_given_tensor_writes_it_and_refuses_one_of_another_size() -> None:
    stored = codec.encode(torch.randn(1000) * 0.05, "nf4")
    out = torch.full((1000,), 7.0)
    assert codec.decode(stored, 1000, "nf4", out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, codec.decode(stored, 1000, "nf4"))
    with pytest.raises(ValueError, match="`out` must be a contiguous torch.float32 tensor of 1000 values"):
        codec.decode(stored, 1000, "nf4", out=torch.empty(999))
