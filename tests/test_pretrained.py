"""``from_pretrained`` + PEFT inside ``configure_model``, as users of large models write it: the weights land in
ZeRO-3 shards bit for bit, each rank reading only its slice, and everything after (train, save, resume on another
world size, validate, load without DeepSpeed) works on that path."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_frozen
from examples.causal_lm_lora.make_base import write_random_llama
from lightning_frozen import progress
from lightning_frozen.format import layout
from lightning_frozen.hf import transformers_loading
from lightning_frozen.zero import engine
from lightning_frozen.zero.init import outside_zero_init
from tests.distributed import read_reports, run_in_this_process, run_script
from tests.models import AdapterModel, cpu_trainer, regression_data
from tests.pretrained_support import (
    MOE_CONFIGS,
    TINY_LLAMA,
    ExpertsLoRA,
    HeldMoE,
    PretrainedLoRA,
    folder_tensors,
    moe_folder,
    token_data,
    write_llama,
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama") / "base")


@pytest.mark.parametrize(("precision", "shard_dtype"), [("bf16-mixed", "bfloat16"), ("32-true", "float32")])
def test_configure_model_loads_the_folder_bit_for_bit_into_shards(
    llama_folder: Path, precision: str, shard_dtype: str, lightning_log: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(progress, "INTERVAL_SECONDS", 0.0)
    built_in: list[torch.dtype] = []
    build_layer = modeling_llama.LlamaDecoderLayer.__init__

    def recording(layer: nn.Module, *args: object, **kwargs: object) -> None:
        built_in.append(torch.get_default_dtype())
        build_layer(layer, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "__init__", recording)
    model = PretrainedLoRA(str(llama_folder))
    trainer = cpu_trainer(max_steps=2, precision=precision)
    trainer.fit(model, token_data())

    seen = model.seen_at_start
    assert len(seen["frozen_equal"]) == len(folder_tensors(llama_folder)) == 21
    assert all(seen["frozen_equal"].values()), [k for k, same in seen["frozen_equal"].items() if not same]
    assert len(seen["lora_b_zero"]) == 4 and all(seen["lora_b_zero"].values())  # PEFT's init was not a no-op
    assert {s["dtype"] for s in seen["shards"].values()} == {shard_dtype}  # the compute dtype, whatever was saved
    # built in it too: built in the file's bf16, zero.Init would cast every full tensor to fp32 before the load
    assert built_in and set(built_in) == {getattr(torch, shard_dtype)}
    assert trainer.global_step == 2
    assert "loaded " + str(llama_folder) + " into ZeRO-3 shards: 21 tensors" in lightning_log.text
    assert "lightning-frozen: loading the frozen base: 1 tensors" in lightning_log.text  # progress on long loads
    assert "rank 0 reads each tensor" not in lightning_log.text
    # the bytes counted are the (bf16) files', also when the model computes in fp32
    file_mib = sum(t.numel() * t.element_size() for t in folder_tensors(llama_folder).values()) / 2**20
    assert f"of {file_mib:,.1f} MiB (100%)" in lightning_log.text


def test_a_plain_folder_loads_in_slices_whatever_became_of_transformers_converter(
    llama_folder: Path, lightning_log: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the converter's names are capability CONVERTED_LOADING's, for folders whose tensors transformers converts: a
    # release that moved one must not reach a Llama folder's load
    import peft.utils.transformers_weight_conversion  # noqa: F401 - PEFT imports it itself, once
    from transformers import core_model_loading

    monkeypatch.delattr(core_model_loading, "dot_natural_key")
    monkeypatch.setenv("LIGHTNING_FROZEN_CODE_CACHE", str(tmp_path / "codes"))  # read from the folder, not the cache
    model = PretrainedLoRA(str(llama_folder))
    cpu_trainer(max_steps=1).fit(model, token_data())
    assert all(model.seen_at_start["frozen_equal"].values())
    assert "loaded " + str(llama_folder) + " into ZeRO-3 shards: 21 tensors" in lightning_log.text
    assert "rank 0 reads each tensor" not in lightning_log.text


def test_the_base_is_loaded_in_slices_when_configure_model_first_imports_transformers_and_peft(
    llama_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a late import used to meet the capabilities' lookup mid-import: sliced loading was then turned off for good
    monkeypatch.setenv("LIGHTNING_FROZEN_CODE_CACHE", str(tmp_path / "codes"))  # read from the folder, not the cache
    run_script("first_import_in_configure_model.py", str(llama_folder), str(tmp_path / "report.json"))
    found = json.loads((tmp_path / "report.json").read_text())
    assert found == dict(imported_before=[], sliced=True)


def test_adapter_from_a_configure_model_base_loads_without_deepspeed(llama_folder: Path, tmp_path: Path) -> None:
    model = PretrainedLoRA(str(llama_folder), lr=0.05)
    trainer = cpu_trainer(max_steps=3)
    trainer.fit(model, token_data())
    trainer.save_checkpoint(tmp_path / "adapter.ckpt")
    (trained,) = trainer.validate(model, token_data())
    (fresh,) = cpu_trainer().validate(
        PretrainedLoRA(str(llama_folder)), token_data(), ckpt_path=tmp_path / "adapter.ckpt"
    )
    assert fresh["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-6)  # a new Trainer, base built anew
    saved = torch.load(tmp_path / "adapter.ckpt", weights_only=True)
    assert sorted(saved["state_dict"]) == sorted(n for n, p in model.named_parameters() if p.requires_grad)

    loaded = lightning_frozen.load_from_checkpoint(PretrainedLoRA, tmp_path / "adapter.ckpt")  # calls configure_model
    assert not any(hasattr(p, "ds_id") for p in loaded.parameters())
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.detach(), saved["state_dict"][name], rtol=0, atol=0)
    assert any(float(saved["state_dict"][n].abs().sum()) > 0 for n in saved["state_dict"] if "lora_B" in n)
    reference = folder_tensors(llama_folder)
    embed = loaded.model.base_model.model.model.embed_tokens.weight
    assert torch.equal(embed.detach().to(torch.bfloat16), reference["model.embed_tokens.weight"])

    tampered = dict(reference)
    tampered["model.norm.weight"] = tampered["model.norm.weight"] + 1
    other = tmp_path / "other"
    write_llama(other)
    from safetensors.torch import save_file

    save_file(tampered, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(lightning_frozen.FrozenBaseMismatchError, match="model.norm.weight"):
        lightning_frozen.load_from_checkpoint(PretrainedLoRA, tmp_path / "adapter.ckpt", folder=str(other))


@pytest.mark.slow
def test_two_ranks_load_their_own_halves_then_resume_on_one(llama_folder: Path, tmp_path: Path) -> None:
    two, one = tmp_path / "two", tmp_path / "one"
    checkpoint = tmp_path / "two.ckpt"
    run_script("pretrained_lora.py", "--folder", str(llama_folder), "--save", str(checkpoint), "--report", str(two))
    reports = read_reports(two)
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert all(report["frozen_equal"].values())
        assert all(report["lora_b_zero"].values())
        for name, shard in report["shards"].items():
            assert shard["shard_numel"] == math.ceil(shard["numel"] / 2), name
            assert shard["device"] == "cpu"
    assert [r["global_step"] for r in reports] == [2, 2]
    assert reports[0]["val_loss"] == pytest.approx(reports[1]["val_loss"])  # one base, one adapter on both ranks

    run_in_this_process(
        "pretrained_lora.py",
        *("--folder", str(llama_folder), "--devices", "1", "--max-steps", "4"),
        *("--resume", str(checkpoint), "--report", str(one)),
    )
    (resumed,) = read_reports(one)
    assert resumed["global_step"] == 4
    assert all(resumed["frozen_equal"].values())


def test_a_weight_the_folder_lacks_is_initialised_once_for_both_ranks(llama_folder: Path, tmp_path: Path) -> None:
    """The loader skips zero.Init's broadcast of each weight as it is built; a weight no file holds is still the same
    on every rank, as transformers initialises it on rank 0 and broadcasts it."""
    from safetensors.torch import save_file

    folder = tmp_path / "no_head"
    folder.mkdir()
    (folder / "config.json").write_text((llama_folder / "config.json").read_text())
    tensors = folder_tensors(llama_folder)
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    run_script("pretrained_lora.py", "--folder", str(folder), "--report", str(tmp_path / "report"))
    reports = read_reports(tmp_path / "report")
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(all(r["frozen_equal"].values()) and len(r["frozen_equal"]) == 20 for r in reports)
    heads = [r["not_in_folder"]["lm_head.weight"] for r in reports]
    assert heads[0] == heads[1], heads  # one initialisation, not one per rank
    assert heads[0][1] > 0.0  # initialised, not left empty


def test_a_bin_checkpoint_goes_through_transformers_own_loader(tmp_path: Path, lightning_log: object) -> None:
    folder = write_llama(tmp_path / "bin", safe_serialization=False)
    assert (folder / "pytorch_model.bin").exists() and not (folder / "model.safetensors").exists()
    model = PretrainedLoRA(str(folder))
    trainer = cpu_trainer(max_steps=1, precision="bf16-mixed")
    trainer.fit(model, token_data())
    assert "rank 0 reads each tensor and broadcasts it" in lightning_log.text
    assert len(model.seen_at_start["frozen_equal"]) == 21 and all(model.seen_at_start["frozen_equal"].values())


def _sharded_llama_with_a_broken_shard(folder: Path, damage: str) -> Path:
    """A tiny Llama saved by ``save_pretrained`` in several shards, the second one truncated or its header garbled."""
    model = write_random_llama(folder, TINY_LLAMA)
    model.save_pretrained(folder, max_shard_size="40KB")
    (folder / "model.safetensors").unlink(missing_ok=True)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    broken = shards[1]
    data = broken.read_bytes()
    broken.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 8 + data[8:])
    return broken


@pytest.mark.parametrize("damage", ["truncated", "garbled header"])
def test_a_broken_shard_is_named_with_the_fix_under_the_strategy(tmp_path: Path, damage: str) -> None:
    broken = _sharded_llama_with_a_broken_shard(tmp_path / "base", damage)
    with pytest.raises(lightning_frozen.FrozenBaseFileError, match="truncated or corrupt") as caught:
        cpu_trainer(max_steps=1).fit(PretrainedLoRA(str(broken.parent)), token_data())
    assert str(broken) in str(caught.value) and "Download or copy that file again" in str(caught.value)
    assert caught.value.path == str(broken) and isinstance(caught.value, OSError)
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)


def test_a_broken_shard_is_named_when_transformers_own_loader_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _sharded_llama_with_a_broken_shard(tmp_path / "base", "truncated")
    monkeypatch.setattr(transformers_loading, "available", lambda capability: False)  # sliced loading off
    with pytest.raises(lightning_frozen.FrozenBaseFileError, match=str(broken)):
        cpu_trainer(max_steps=1).fit(PretrainedLoRA(str(broken.parent)), token_data())


def test_a_broken_shard_is_named_when_loading_without_deepspeed(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    broken = _sharded_llama_with_a_broken_shard(tmp_path / "base", "truncated")
    named = transformers_loading.base_files_named()  # what `load_from_checkpoint` runs `configure_model` under
    with pytest.raises(lightning_frozen.FrozenBaseFileError, match=str(broken)), named:
        AutoModelForCausalLM.from_pretrained(str(broken.parent))


def test_place_buffers_moves_buffers_and_metric_states_but_no_param() -> None:
    from torchmetrics.classification import MulticlassAccuracy

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.metric = MulticlassAccuracy(num_classes=3)
    engine.place_buffers(model, torch.device("meta"))  # the CPU cannot show a GPU; the meta device shows the move
    assert {b.device.type for b in model.buffers()} == {"meta"}
    assert model.metric.tp.device.type == "meta"
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_progress_counts_only_what_is_loaded_and_never_goes_backwards(
    tmp_path: Path, lightning_log: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    from safetensors.torch import load_file, save_file

    folder = write_llama(tmp_path / "with_extra")
    # a folder holding more than the model uses (a CLIP folder of which only the vision tower is built)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["text_model.unused.weight"] = torch.ones(512, 512)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(progress, "INTERVAL_SECONDS", -1.0)  # a line for every tensor
    cpu_trainer(max_steps=1, precision="bf16-mixed").fit(PretrainedLoRA(str(folder)), token_data())

    def percents(prefix: str) -> list[int]:
        lines = [line for line in lightning_log.lines if line.startswith(prefix)]  # type: ignore[attr-defined]
        assert all("/s" in line for line in lines), lines
        assert all("left" in line for line in lines if "(100%)" not in line), lines
        return [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines]  # type: ignore[union-attr]

    loading = percents("lightning-frozen: loading the frozen base") + percents("lightning-frozen: loaded ")
    assert len(loading) == 22 and loading == sorted(loading) and loading[-1] == 100
    # the fingerprint came from the values as they were read: no second pass over the base
    assert "fingerprinting the frozen base" not in lightning_log.text  # type: ignore[attr-defined]


def _set_by_decorator(cls: type) -> type:
    """A class decorator that works as the ``kernels`` package's ``use_kernelized_func`` (transformers 5.25's
    attention layers): its ``__init__`` sets what its ``forward`` reads."""
    own_init, own_forward = cls.__init__, cls.forward

    def init(self: nn.Module, *args: object, **kwargs: object) -> None:
        own_init(self, *args, **kwargs)
        self.__dict__["set_by_decorator"] = True

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        assert self.__dict__.get("set_by_decorator"), "built without the decorator's __init__"
        return own_forward(self, x)

    cls.__init__, cls.forward = init, forward
    return cls


class _DecoratedInConfigureModel(AdapterModel):
    """Defines a decorated module class inside ``configure_model`` (as a model class first imported there is), and
    builds it there, again outside zero.Init within it, and keeps the class for after the fit."""

    def configure_model(self) -> None:
        @_set_by_decorator
        class Block(nn.Linear):
            def __init__(self, width: int) -> None:
                super().__init__(width, width)

        self.block_class = Block
        self.inside = Block(8)
        with outside_zero_init():
            self.outside = Block(8)
        self.after_outside = Block(8)


def test_a_module_class_first_defined_in_configure_model_keeps_its_decorated_init() -> None:
    module = _DecoratedInConfigureModel(width=8)
    cpu_trainer(max_steps=1).fit(module, regression_data(width=8))
    built = [module.inside, module.outside, module.after_outside, module.block_class(8)]
    assert [b.__dict__.get("set_by_decorator") for b in built] == [True] * 4
    assert hasattr(module.inside.weight, "ds_id") and not hasattr(built[-1].weight, "ds_id")  # shard vs plain
    assert built[-1](torch.ones(1, 8)).shape == (1, 8)


class BaseInInit(PretrainedLoRA):
    """The base loaded in ``__init__``, as most users' modules do."""

    def __init__(self, folder: str, lr: float = 1e-2) -> None:
        super().__init__(folder, lr)
        self.configure_model()


@pytest.mark.parametrize("module_class", [BaseInInit, PretrainedLoRA], ids=["__init__", "configure_model"])
def test_a_base_folder_that_moved_is_named_with_the_argument_that_moves_it(tmp_path: Path, module_class: type) -> None:
    gone = str(tmp_path / "moved" / "base")  # a folder path transformers reads as a malformed hub id
    entry = layout.new_frozen_base_entry(gone, layout.fingerprint_entry("none", None, {}))
    lightning = {"hyper_parameters": {"folder": gone, "lr": 0.01}}
    torch.save(layout.assemble(lightning, {}, None, entry, layout.format_marker()), tmp_path / "adapter.ckpt")

    with pytest.raises(lightning_frozen.BaseFolderError) as raised:
        lightning_frozen.load_from_checkpoint(module_class, tmp_path / "adapter.ckpt")

    message = str(raised.value)
    assert f"trained on the frozen base {gone!r}, which is no folder now" in message
    assert f"`{module_class.__name__}.load_from_checkpoint(path, folder='path/to/base')`" in message
    assert "`--base path/to/base`" in message
    assert isinstance(raised.value.__cause__, (OSError, ValueError))


@pytest.mark.parametrize(("kind", "frozen_dtype"), [("qwen3_moe", None), ("mixtral", None), ("qwen3_moe", "nf4")])
def test_lora_on_the_fused_experts_alone_trains_from_the_first_moe_block(
    kind: str, frozen_dtype: str | None, tmp_path: Path
) -> None:
    # DeepSpeed makes these MoE blocks ZeRO-3 leaves; no input of the first one requires grad here (issue 51)
    from transformers import AutoModelForCausalLM

    folder = moe_folder(tmp_path / "base", kind)
    module = ExpertsLoRA(str(folder), lr=5e-2)
    strategy = lightning_frozen.FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype)
    cpu_trainer(strategy=strategy, max_steps=2, precision="32-true").fit(module, token_data())
    first = module.batches[0]
    with torch.no_grad():  # LoRA B starts at zero: PEFT's model computes the plain model's loss
        plain = float(AutoModelForCausalLM.from_pretrained(str(folder))(input_ids=first, labels=first).loss)
    assert module.losses[0] == pytest.approx(plain, rel=1e-5 if frozen_dtype is None else 2e-2)
    assert sorted({name.split(".mlp.")[0].split(".")[-1] for name in module.experts_lora_b}) == ["0", "1"]
    assert len(module.experts_lora_b) == 4  # gate_up_proj and down_proj in each layer
    for name, lora_b in module.experts_lora_b.items():
        assert lora_b.abs().sum() > 0, name


@pytest.fixture
def zero3_loader_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The classes of the models transformers' own ZeRO-3 loader (``_load_state_dict_into_zero3_model``) loads during
    the test."""
    import functools

    from transformers import modeling_utils

    calls: list[str] = []
    original = modeling_utils._load_state_dict_into_zero3_model

    @functools.wraps(original)
    def recording(model_to_load: nn.Module, *args: object, **kwargs: object) -> object:
        calls.append(type(model_to_load).__name__)
        return original(model_to_load, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "_load_state_dict_into_zero3_model", recording)
    return calls


def _fit_held_moe(folder: Path, frozen_dtype: str | None = None, fingerprint: str = "checksum", **kwargs: Any) -> Any:
    module = HeldMoE(str(folder), lr=5e-2, **kwargs)
    strategy = lightning_frozen.FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype, fingerprint=fingerprint)
    cpu_trainer(strategy=strategy, max_steps=1, precision="32-true").fit(module, token_data())
    return module


def _assert_held_as_transformers_loads(folder: Path, module: Any, frozen_dtype: str | None) -> None:
    """``module`` (a fit of :class:`HeldMoE` on ``folder``) against transformers' plain load of it (fp32): every param
    equal (stored as ``frozen_dtype``, the codes of encoding the plain load's values), the first loss the plain
    model's."""
    from transformers import AutoModelForCausalLM

    from lightning_frozen.format import codec

    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    expected = plain.state_dict()
    held = module.held
    assert sorted(held["values"]) == sorted(expected)
    frozen_experts = {name for name in held["shards"] if ".experts." in name}
    assert frozen_experts and frozen_experts <= set(held["recorded"])  # checksummed as they were read
    for name, value in expected.items():
        shard, (start, count), numel = held["shards"].get(name, (value, (0, 0), 0))
        if frozen_dtype is None or shard.dtype != torch.uint8:  # unquantized, or trained: the exact values
            assert torch.equal(held["values"][name], value), name
            continue
        assert torch.equal(shard, codec.encode(value.reshape(-1)[start : start + count], frozen_dtype, numel)), name
    if frozen_dtype is not None:
        assert all(held["shards"][name][0].dtype == torch.uint8 for name in frozen_experts)
    # a gather before setup reads the exact values where they lie in the folder, whatever the shard holds
    assert torch.equal(module.gathered_before_setup, expected["model.layers.0.mlp.experts.gate_up_proj"])
    batch = module.batches[0]
    with torch.no_grad():
        first = float(plain(input_ids=batch, labels=batch).loss)
    assert module.losses[0] == pytest.approx(first, rel=1e-5 if frozen_dtype is None else 2e-2)


@pytest.mark.parametrize("folder_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_a_moe_folder_loads_in_slices_as_transformers_own_load_holds_it(
    kind: str, folder_dtype: torch.dtype, tmp_path: Path, zero3_loader_calls: list, lightning_log: Any
) -> None:
    # the folder stores each expert's tensors; transformers fuses them into mlp.experts.gate_up_proj / down_proj
    folder = moe_folder(tmp_path / "base", kind, folder_dtype)
    assert any(".experts.1." in key for key in folder_tensors(folder))
    mode = "sha256" if folder_dtype == torch.bfloat16 else "checksum"
    plain = _fit_held_moe(folder, fingerprint=mode)
    assert zero3_loader_calls == [] and "needs transformers' own ZeRO-3 loader" not in lightning_log.text
    assert f"loaded {folder} into ZeRO-3 shards" in lightning_log.text
    _assert_held_as_transformers_loads(folder, plain, None)
    # the record taken as the slices were read is what a pass over the shards finds
    assert plain.held["fingerprint"] == plain.held["fingerprint_by_a_pass"]
    if folder_dtype == torch.bfloat16:  # stored as NF4 as it is read, the fingerprint still that of the source values
        quantized = _fit_held_moe(folder, "nf4", fingerprint=mode)
        assert zero3_loader_calls == [] and quantized.held["quantized_at_load"] > 0
        _assert_held_as_transformers_loads(folder, quantized, "nf4")
        assert quantized.held["fingerprint"] == plain.held["fingerprint"]


def test_experts_whose_layout_is_no_runs_are_built_whole_one_layer_at_a_time(
    tmp_path: Path, zero3_loader_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced here: transformers stacks Qwen3-MoE's experts, but where a converter lays them out otherwise (transposed,
    interleaved) ``expert_runs`` finds no runs, and each fused tensor is built whole from its folder tensors by
    transformers' converter, then sliced."""
    from lightning_frozen.hf import conversions

    built: list[str] = []
    converted = conversions.converted

    def recording(model: nn.Module, conversion: Any, tensors: Any) -> dict[str, torch.Tensor]:
        tensors = list(tensors)
        if not tensors[0].is_meta:
            built.append(conversion.target)
        return converted(model, conversion, tensors)

    monkeypatch.setattr(conversions, "expert_runs", lambda *args: None)
    monkeypatch.setattr(conversions, "converted", recording)
    folder = moe_folder(tmp_path / "base", "qwen3_moe", torch.bfloat16)
    plain = _fit_held_moe(folder)
    assert zero3_loader_calls == []
    experts = [f"model.layers.{layer}.mlp.experts.{name}" for layer in (0, 1) for name in ("gate_up_proj", "down_proj")]
    assert sorted(built) == sorted(experts)  # each built once, from its own layer's experts
    _assert_held_as_transformers_loads(folder, plain, None)
    assert plain.held["fingerprint"] == plain.held["fingerprint_by_a_pass"]
    # stored as NF4 as it is read; layer 0's trained down_proj gets its exact values back, built again, at setup
    quantized = _fit_held_moe(folder, "nf4", train_expert=True)
    assert zero3_loader_calls == [] and quantized.held["quantized_at_load"] > 0
    assert "model.layers.0.mlp.experts.down_proj" not in quantized.held["shards"]
    _assert_held_as_transformers_loads(folder, quantized, "nf4")
