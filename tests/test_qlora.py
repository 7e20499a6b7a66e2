"""A QLoRA user's code (PEFT's DeepSpeed guide: ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4", ...))`` and ``get_peft_model`` in ``configure_model``) under
``frozen_deepspeed``, unchanged: the base stored as the strategy's NF4 shards, exactly as ``frozen_dtype="nf4"``
stores it, and what cannot map refused with the setting and the fix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import lightning_frozen
from lightning_frozen import BitsAndBytesConfigError, FrozenAwareDeepSpeedStrategy
from lightning_frozen.base import qlora
from lightning_frozen.hf import transformers_loading
from tests.distributed import chained, read_reports, run_script
from tests.models import cpu_trainer
from tests.pretrained_support import QLoRA, folder_tensors, token_data, write_llama


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama") / "base")


def _fit(module: QLoRA, strategy: FrozenAwareDeepSpeedStrategy, steps: int = 3, **kwargs: object) -> object:
    trainer = cpu_trainer(strategy, max_steps=steps, max_epochs=-1, precision="32-true", **kwargs)
    trainer.fit(module, token_data())
    return trainer


def test_the_guides_qlora_code_trains_on_the_strategys_nf4_shards(
    llama_folder: Path, tmp_path: Path, lightning_log: object
) -> None:
    torch.manual_seed(0)
    module = QLoRA(str(llama_folder))
    strategy = FrozenAwareDeepSpeedStrategy()
    trainer = _fit(module, strategy)
    seen = module.seen_at_start

    assert strategy.frozen_dtype == "nf4" and seen["frozen_dtype"] == "nf4"
    assert "`quantization_config=BitsAndBytesConfig(load_in_4bit, nf4)` is the strategy's `frozen_dtype='nf4'`" in (
        lightning_log.text
    )
    assert "layers compute in float32 (the Trainer's precision; `bnb_4bit_compute_dtype=bfloat16` is not used)" in (
        lightning_log.text
    )
    # no bitsandbytes layer: plain nn.Linear over ZeRO-3 shards of NF4 codes, each encoded as it was read
    assert not any("bitsandbytes" in type(m).__module__ for m in module.modules())
    assert len(seen["codes"]) == len(folder_tensors(llama_folder)) == 21 == seen["quantized_at_load"]
    assert {dtype for dtype, _ in seen["codes"].values()} == {"torch.uint8"}
    # the weights in use are the folder's, quantized: decode(encode(value))
    assert all(seen["quantized_equal"].values()), [k for k, same in seen["quantized_equal"].items() if not same]
    # the adapter trains
    assert len(module.losses) == 3 and all(math.isfinite(loss) for loss in module.losses)
    assert all(float(b.abs().sum()) == 0 for b in seen["lora_b"].values())  # PEFT starts LoRA B at zero
    trained_b = [p for n, p in module.named_parameters() if "lora_B" in n]
    assert all(float(p.ds_tensor.abs().sum()) > 0 for p in trained_b)

    # the same shards, bytes and fingerprint as `frozen_dtype="nf4"` over the plain load gives
    plain_strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4")
    plain = QLoRA(str(llama_folder), quantization=None)
    _fit(plain, plain_strategy, steps=1)
    assert plain.seen_at_start["codes"] == seen["codes"]
    assert plain.seen_at_start["fingerprint"] == seen["fingerprint"]

    # the checkpoint resumes, on a new Trainer and module built the same way
    trainer.save_checkpoint(tmp_path / "qlora.ckpt")
    saved = torch.load(tmp_path / "qlora.ckpt", weights_only=True)
    assert saved["frozen_base"]["quantization"]["dtype"] == "nf4"
    resumed = QLoRA(str(llama_folder))
    resumed_trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), max_steps=5, max_epochs=-1, precision="32-true")
    resumed_trainer.fit(resumed, token_data(), ckpt_path=tmp_path / "qlora.ckpt")
    assert resumed_trainer.global_step == 5 and len(resumed.losses) == 2
    assert "was trained on a frozen base stored as" not in lightning_log.text

    # and it loads for use without DeepSpeed: the unquantized base (the one the fingerprint is of) and the adapter
    loaded = lightning_frozen.load_from_checkpoint(QLoRA, tmp_path / "qlora.ckpt")
    assert "is taken off `from_pretrained`: the base loads unquantized" in lightning_log.text
    assert not any(hasattr(p, "ds_id") for p in loaded.parameters())
    assert not any("bitsandbytes" in type(m).__module__ for m in loaded.modules())
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.detach().float(), saved["state_dict"][name].float()), name
    embed = loaded.model.base_model.model.model.embed_tokens.weight
    assert torch.equal(embed.detach(), folder_tensors(llama_folder)["model.embed_tokens.weight"])
    assert torch.isfinite(loaded(torch.arange(8).view(1, 8))).all()


def test_prepare_model_for_kbit_training_keeps_the_shards_as_codes(llama_folder: Path) -> None:
    torch.manual_seed(0)
    module = QLoRA(str(llama_folder), kbit_training=True)
    _fit(module, FrozenAwareDeepSpeedStrategy(), steps=2)
    # its fp32 cast met 0-element placeholders: no full copy of any weight, the shards still NF4 codes
    assert module.prepared and all(numel == 0 for numel, _ in module.prepared.values())
    assert {dtype for _, dtype in module.prepared.values()} == {torch.uint8}
    assert {dtype for dtype, _ in module.seen_at_start["codes"].values()} == {"torch.uint8"}
    assert all(module.seen_at_start["quantized_equal"].values())
    # it prepared the model as a k-bit one: gradient checkpointing on
    assert module.model.base_model.model.is_gradient_checkpointing
    assert len(module.losses) == 2 and all(math.isfinite(loss) for loss in module.losses)
    assert all(float(p.ds_tensor.abs().sum()) > 0 for n, p in module.named_parameters() if "lora_B" in n)


def test_load_in_8bit_trains_on_int8_shards(llama_folder: Path, lightning_log: object) -> None:
    module = QLoRA(str(llama_folder), quantization="int8")
    strategy = FrozenAwareDeepSpeedStrategy()
    _fit(module, strategy, steps=1)
    assert strategy.frozen_dtype == "int8" and module.seen_at_start["quantized_at_load"] == 21
    assert all(module.seen_at_start["quantized_equal"].values())
    assert "`quantization_config=BitsAndBytesConfig(load_in_8bit)` is the strategy's `frozen_dtype='int8'`" in (
        lightning_log.text
    )


@pytest.mark.parametrize(
    ("kwargs", "strategy_kwargs", "message"),
    [
        (dict(quantization="fp4"), {}, "`bnb_4bit_quant_type='fp4'`: the strategy stores a 4-bit frozen base as NF4"),
        (
            dict(bnb={"llm_int8_skip_modules": ["lm_head"]}),
            {},
            "`llm_int8_skip_modules=['lm_head']`: the strategy stores every frozen param in one `frozen_dtype`",
        ),
        (
            dict(quantization="int8", bnb={"llm_int8_has_fp16_weight": True}),
            {},
            "`llm_int8_has_fp16_weight=True` trains the int8 base itself",
        ),
        (
            {},
            dict(frozen_dtype="int8"),
            "asks for `frozen_dtype='nf4'`, but the strategy has `frozen_dtype='int8'`. Keep one of them",
        ),
    ],
)
def test_what_cannot_map_is_refused_with_the_setting_and_the_fix(
    llama_folder: Path, kwargs: dict, strategy_kwargs: dict, message: str
) -> None:
    with pytest.raises(BitsAndBytesConfigError, match=_literal(message)):
        _fit(QLoRA(str(llama_folder), **kwargs), FrozenAwareDeepSpeedStrategy(**strategy_kwargs), steps=1)


def test_a_pre_quantized_8bit_folder_is_refused(tmp_path: Path) -> None:
    # a 4-bit nf4 one loads as its codes: tests/test_prequantized.py
    folder = write_llama(tmp_path / "prequantized")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(BitsAndBytesConfigError, match="stored quantized by bitsandbytes as 8-bit"):
        _fit(QLoRA(str(folder)), FrozenAwareDeepSpeedStrategy(), steps=1)


def test_a_base_bitsandbytes_quantized_in_init_is_refused_with_the_move_to_configure_model(llama_folder: Path) -> None:
    module = QLoRA(str(llama_folder), in_init=True)  # bitsandbytes quantizes it for real, on the CPU
    assert transformers_loading.bitsandbytes_layers(module)
    with pytest.raises(BitsAndBytesConfigError, match="Move the `from_pretrained` and `get_peft_model` calls from"):
        _fit(module, FrozenAwareDeepSpeedStrategy(), steps=1)


def test_load_in_8bit_is_int8_and_double_quantization_is_nf4_with_a_notice(llama_folder: Path) -> None:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    taken = []
    configs = [
        BitsAndBytesConfig(load_in_8bit=True),
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    ]
    with transformers_loading.bitsandbytes_taken_off(taken.append) as wrapped:
        for config in configs:
            model = AutoModelForCausalLM.from_pretrained(llama_folder, quantization_config=config)
            assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # bitsandbytes did not quantize
    assert wrapped
    eight, four = taken
    assert qlora.frozen_dtype_for(eight, None) == "int8" and qlora.frozen_dtype_for(four, "nf4") == "nf4"
    assert "`bnb_4bit_use_double_quant` is not applied: fp16 scales, 0.531 bytes per weight against 0.516" in (
        qlora.notice(four, "nf4", torch.bfloat16)
    )
    # and the patch is gone afterwards
    from transformers import modeling_utils

    assert modeling_utils.get_hf_quantizer.__module__ == "transformers.quantizers.auto"


def _literal(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.slow
def test_two_ranks_train_resume_and_load_the_guides_qlora_code(llama_folder: Path, tmp_path: Path) -> None:
    def arguments(name: str, *args: str) -> list[str]:
        return ["--folder", str(llama_folder), "--report", str(tmp_path / name), *args]

    runs = [
        arguments("qlora", "--save", str(tmp_path / "qlora.ckpt")),
        arguments("plain", "--plain-nf4"),
        arguments("resumed", "--resume", str(tmp_path / "qlora.ckpt"), "--max-steps", "4"),
    ]
    run_script("qlora.py", *chained(*runs), timeout=600)  # one world for the three runs
    qlora_run, plain, resumed = (read_reports(tmp_path / name) for name in ("qlora", "plain", "resumed"))
    assert len(qlora_run) == len(plain) == 2
    for ours, theirs in zip(qlora_run, plain):  # rank by rank
        assert ours["frozen_dtype"] == "nf4" and ours["quantized_at_load"] == 21
        assert ours["codes"] == theirs["codes"] and ours["fingerprint"] == theirs["fingerprint"]
        assert all(ours["quantized_equal"].values()), ours["quantized_equal"]
        assert ours["global_step"] == 2 and all(math.isfinite(loss) for loss in ours["losses"])
        assert ours["lora_b_trained"] and all(ours["lora_b_trained"].values())
    assert qlora_run[0]["codes"] != qlora_run[1]["codes"]
    assert [r["global_step"] for r in resumed] == [4, 4]
    saved = torch.load(tmp_path / "qlora.ckpt", weights_only=True)
    loaded = lightning_frozen.load_from_checkpoint(QLoRA, tmp_path / "qlora.ckpt")
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.detach().float(), saved["state_dict"][name].float()), name
