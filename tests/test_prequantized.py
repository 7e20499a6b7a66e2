"""A folder bitsandbytes saved as 4-bit nf4 (made here with bitsandbytes itself, on the CPU) under
``frozen_deepspeed``: it loads as its own codes, with or without double quantization, with or without a
``BitsAndBytesConfig`` in the call, on 1 and 2 ranks; the weights in use are bitsandbytes' dequantization with the
scales rounded up to fp16; it trains, resumes, exports to PEFT, and its fingerprint is of what the folder holds. Other
pre-quantized folders are refused with the format and the fix."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_frozen
from lightning_frozen import BitsAndBytesConfigError, FrozenAwareDeepSpeedStrategy, FrozenBaseMismatchError
from lightning_frozen.base import prequantized, qlora, slice_reads
from lightning_frozen.errors import UnsupportedConfigurationError
from lightning_frozen.hf import transformers_loading
from tests.distributed import chained, read_reports, run_script
from tests.models import cpu_trainer
from tests.pretrained_support import plain_name, token_data, write_llama
from tests.scripts.prequantized_fit import PrequantizedLoRA, bitsandbytes_folder, bitsandbytes_reference

BOUND = 2.0**-10  # a weight's error, relative to itself, from the scale rounded up to fp16


@pytest.fixture(scope="module", params=[False, True], ids=["absmax", "double-quant"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    made = bitsandbytes_folder(tmp_path_factory.mktemp("bnb") / "base", double_quant=request.param)
    torch.save(bitsandbytes_reference(made), made.parent / "reference.pt")
    return made


@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "double-quant"])
def test_a_slice_reads_only_its_blocks_and_gives_bitsandbytes_values(tmp_path: Path, double_quant: bool) -> None:
    from bitsandbytes import functional
    from safetensors.torch import save_file

    weight = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))  # 500: the last block's 52 in 26 bytes
    packed, state = functional.quantize_4bit(weight, quant_type="nf4", compress_statistics=double_quant)
    tensors = {"w.weight": packed, **{f"w.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    run_script("prequantized_reference.py", str(tmp_path), str(tmp_path / "reference.pt"))
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)["w.weight"]["values"].reshape(-1)

    file = str(tmp_path / "model.safetensors")
    index = slice_reads.FolderIndex([file])
    source = prequantized.packed_source("w.weight", index)
    assert source is not None and source.shape == (5, 100)
    assert torch.equal(source.read(0, 500), reference)
    assert torch.equal(source.read(100, 300), reference[100:400]) and torch.equal(source.read(448, 52), reference[448:])
    assert source.reads(192, 64) == [slice_reads.SliceRead(file, "w.weight", 96, 32)]  # one block's 32 bytes
    assert prequantized.packed_source("w.weight.absmax", index) is None


def _fit(module: PrequantizedLoRA, steps: int = 2, ckpt_path: Any = None) -> Any:
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), max_steps=steps, max_epochs=-1)
    trainer.fit(module, token_data(), ckpt_path=ckpt_path)
    return trainer


def _held_as_bitsandbytes_stored(seen: dict[str, Any]) -> None:
    weights = seen["weights"]
    assert len(weights) == 14  # q, k, v, o, gate, up, down of two layers
    for name, held in weights.items():
        assert held["whole_blocks"] > 0 and held["cut_weights"] == 0, name
        assert held["codes_kept"] and held["scales_rounded_up"], name
        assert 0 < held["relative_error"] < BOUND, name


def test_a_bitsandbytes_nf4_folder_loads_as_its_codes_and_trains(folder: Path, lightning_log: Any) -> None:
    torch.manual_seed(0)
    module = PrequantizedLoRA(str(folder), reference=str(folder.parent / "reference.pt"))
    trainer = _fit(module)

    assert trainer.strategy.frozen_dtype == "nf4"
    assert f"`{folder}` holds bitsandbytes nf4 weights" in lightning_log.text
    assert "the codes are the folder's, the scales fp16 rounded up" in lightning_log.text
    _held_as_bitsandbytes_stored(module.seen_at_start)
    assert len(module.losses) == 2 and all(math.isfinite(loss) for loss in module.losses)
    assert not any("bitsandbytes" in type(m).__module__ for m in module.modules())

    # the QLoRA code written for an unquantized folder, unchanged: the same codes, the same fingerprint
    torch.manual_seed(0)
    again = PrequantizedLoRA(str(folder), with_config=True, reference=str(folder.parent / "reference.pt"))
    _fit(again)
    assert again.seen_at_start == module.seen_at_start and again.losses == module.losses


def test_the_sha256_fingerprint_hashes_bitsandbytes_dequantization(folder: Path) -> None:
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(fingerprint="sha256"), max_steps=1, max_epochs=-1)
    trainer.fit(PrequantizedLoRA(str(folder)), token_data())
    hashed = {plain_name(n): entry for n, entry in trainer.strategy.frozen_base_fingerprint()["tensors"].items()}
    reference = torch.load(folder.parent / "reference.pt", weights_only=True)
    assert len(reference) == 14
    for key, want in reference.items():
        values = want["values"].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert hashed[key]["value"] == hashlib.sha256(values).hexdigest(), key


def test_its_checkpoint_resumes_exports_and_refuses_another_folder(folder: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = PrequantizedLoRA(str(folder))
    trainer = _fit(module)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    resumed = PrequantizedLoRA(str(folder))
    _fit(resumed, steps=3, ckpt_path=str(tmp_path / "run.ckpt"))
    assert len(resumed.losses) == 1  # the fingerprint verified, one more step

    # PEFT's adapter loads into the architecture it was trained on
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = lightning_frozen.export_peft_adapter(tmp_path / "run.ckpt", tmp_path / "adapter")
    unquantized = AutoModelForCausalLM.from_pretrained(folder.with_name(folder.name + "-unquantized"))
    adapted = PeftModel.from_pretrained(unquantized, exported)
    assert sum("lora_B" in name for name, _ in adapted.named_parameters()) == 4

    # one scale changed in the folder: the same codes, another base
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    _change_one_absmax(changed / "model.safetensors", "model.layers.1.self_attn.o_proj.weight.absmax")
    with pytest.raises(FrozenBaseMismatchError, match="`model.base_model.model.model.layers.1.self_attn.o_proj"):
        _fit(PrequantizedLoRA(str(changed)), steps=3, ckpt_path=str(tmp_path / "run.ckpt"))

    # outside the strategy the base loads unquantized: refused with the fix, which then loads and verifies it
    with pytest.raises(BitsAndBytesConfigError, match="Dequantize it once"):
        lightning_frozen.load_from_checkpoint(PrequantizedLoRA, tmp_path / "run.ckpt")
    dequantized = tmp_path / "dequantized"
    AutoModelForCausalLM.from_pretrained(folder).dequantize().save_pretrained(dequantized)
    loaded = lightning_frozen.load_from_checkpoint(PrequantizedLoRA, tmp_path / "run.ckpt", folder=str(dequantized))
    assert sum("lora_B" in name for name, _ in loaded.named_parameters()) == 4

    # the merged export reads the base's stored weights: refused with the same fix, which then merges
    with pytest.raises(UnsupportedConfigurationError, match="holds weights bitsandbytes stored as 4-bit nf4"):
        lightning_frozen.export_merged(tmp_path / "run.ckpt", tmp_path / "merged")
    merged = lightning_frozen.export_merged(tmp_path / "run.ckpt", tmp_path / "merged", base=dequantized)
    assert (merged / "config.json").exists()


def _change_one_absmax(path: Path, key: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    absmax = tensors[key]
    absmax[0] = absmax[0] + 1 if absmax.dtype == torch.uint8 else absmax[0] * 1.5
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128},
            "stored quantized by gptq (`quant_method='gptq'`), a format the strategy cannot read",
        ),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128},
            "stored quantized by awq (`quant_method='awq'`), a format the strategy cannot read",
        ),
        (
            {"quant_method": "bitsandbytes", "load_in_8bit": True},
            "by bitsandbytes as 8-bit (LLM.int8(), a scale per row); the strategy reads bitsandbytes' 4-bit nf4",
        ),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"},
            "by bitsandbytes as 4-bit fp4; the strategy reads bitsandbytes' 4-bit nf4 folders only",
        ),
    ],
    ids=["gptq", "awq", "bnb-8bit", "bnb-fp4"],
)
def test_other_pre_quantized_folders_are_refused_with_the_format_and_the_fix(
    tmp_path: Path, quantization_config: dict, message: str
) -> None:
    from transformers import AutoModelForCausalLM

    base = write_llama(tmp_path / "base")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    refuse = transformers_loading.bitsandbytes_taken_off(lambda settings: qlora.frozen_dtype_for(settings, None))
    with refuse, pytest.raises(BitsAndBytesConfigError) as refused:
        AutoModelForCausalLM.from_pretrained(base)
    assert message in str(refused.value) and "Load the unquantized checkpoint it was made from" in str(refused.value)


def test_an_nf4_folder_under_another_frozen_dtype_is_refused(tmp_path: Path) -> None:
    base = bitsandbytes_folder(tmp_path / "base", double_quant=False)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(frozen_dtype="int8"), max_steps=1, max_epochs=-1)
    with pytest.raises(BitsAndBytesConfigError, match="loads as `frozen_dtype='nf4'`, but the strategy has"):
        trainer.fit(PrequantizedLoRA(str(base)), token_data())


@pytest.mark.slow
def test_two_ranks_load_their_blocks_train_resume_on_one_and_say_what_a_cut_block_costs(tmp_path: Path) -> None:
    # intermediate_size 99: each MLP weight's shard (3168 weights) starts rank 1 inside a block
    base = bitsandbytes_folder(tmp_path / "base", double_quant=True, intermediate_size=99)
    run_script("prequantized_reference.py", str(base), str(tmp_path / "reference.pt"))

    def arguments(name: str, *args: str) -> list[str]:
        return ["--folder", str(base), "--report", str(tmp_path / name), *args]

    runs = [arguments("fit", "--reference", str(tmp_path / "reference.pt"), "--save", str(tmp_path / "run.ckpt"))]
    runs.append(arguments("resumed", "--resume", str(tmp_path / "run.ckpt"), "--max-steps", "3"))
    done = run_script("prequantized_fit.py", *chained(*runs), timeout=600)
    fit, resumed = read_reports(tmp_path / "fit"), read_reports(tmp_path / "resumed")
    assert len(fit) == len(resumed) == 2
    said = done.stdout + done.stderr
    assert said.count("of the bitsandbytes nf4 weights lie in shards that start inside one") == 2, said  # per run
    assert "30% of the bitsandbytes nf4 weights" in said  # rank 1's halves of gate, up and down
    for rank, report in enumerate(fit):
        assert report["frozen_dtype"] == "nf4" and report["global_step"] == 2
        assert not report["bitsandbytes_importable"]  # the ranks load the folder without it
        weights = report["weights"]
        assert len(weights) == 14
        for name, held in weights.items():
            mlp = ".mlp." in name
            assert held["codes_kept"] and held["scales_rounded_up"], (rank, name)
            assert held["relative_error"] < BOUND, (rank, name)
            if mlp and rank == 1:  # every block of the shard straddles two of the folder's
                assert held["whole_blocks"] == 0 and held["cut_weights"] == 3168
                assert 0 < held["cut_error_in_absmax"] < 0.3, name
            elif mlp:  # the shard's last block holds half of one of the folder's
                assert held["whole_blocks"] == 49 and held["cut_weights"] == 32
            else:
                assert held["whole_blocks"] > 0 and held["cut_weights"] == 0
    assert fit[0]["fingerprint"] == fit[1]["fingerprint"]
    assert [r["global_step"] for r in resumed] == [3, 3]
    # the fingerprint is of the folder's values, not of how the ranks stored them: one rank resumes it
    module = PrequantizedLoRA(str(base))
    _fit(module, steps=4, ckpt_path=str(tmp_path / "run.ckpt"))
    assert len(module.losses) == 2
