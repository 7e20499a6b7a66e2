"""Migration from a checkpoint directory written by Lightning's stock DeepSpeedStrategy (ZeRO-3, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_frozen
from lightning_frozen.errors import CheckpointFormatError, FrozenBaseMismatchError
from tests.models import AdapterModel, StockDeepSpeedOnCPU, cpu_trainer, regression_data


def _adam(module: AdapterModel) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=0.02)


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stock") / "stock.ckpt"
    trainer = cpu_trainer(StockDeepSpeedOnCPU(stage=3), max_epochs=1)
    trainer.fit(AdapterModel(optimizer_fn=_adam), regression_data())
    trainer.save_checkpoint(folder)
    assert folder.is_dir()
    return folder


def test_converted_file_holds_the_stock_trainable_state(stock: Path, tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = lightning_frozen.convert_deepspeed_checkpoint(stock, tmp_path / "converted.ckpt", reference="my-base")
    converted = torch.load(out, weights_only=True)
    full = get_fp32_state_dict_from_zero_checkpoint(str(stock), tag="checkpoint")
    trainable = ["head.bias", "head.weight", "layers.0.lora_a", "layers.0.lora_b", "layers.1.lora_a", "layers.1.lora_b"]
    assert sorted(converted["state_dict"]) == trainable
    for name in trainable:
        torch.testing.assert_close(converted["state_dict"][name], full[name].float())
    state = converted["optimizer_states"][0]["state"]["layers.0.lora_b"]
    assert state["exp_avg"].shape == (32, 4) and float(state["step"]) == 8
    assert converted["global_step"] == 8 and converted["frozen_base"]["reference"] == "my-base"
    assert not any(".base." in name for name in converted["state_dict"])


def test_converted_file_resumes_under_the_strategy_and_verifies_the_base(stock: Path, tmp_path: Path) -> None:
    out = lightning_frozen.convert_deepspeed_checkpoint(stock, tmp_path / "converted.ckpt")
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(AdapterModel(optimizer_fn=_adam), regression_data(), ckpt_path=out)
    trainer.save_checkpoint(tmp_path / "again.ckpt")
    before, after = torch.load(out, weights_only=True), torch.load(tmp_path / "again.ckpt", weights_only=True)
    for name, value in before["state_dict"].items():
        torch.testing.assert_close(after["state_dict"][name], value)
        torch.testing.assert_close(
            after["optimizer_states"][0]["state"][name]["exp_avg_sq"],
            before["optimizer_states"][0]["state"][name]["exp_avg_sq"],
        )
    with pytest.raises(FrozenBaseMismatchError):
        lightning_frozen.load_adapter(AdapterModel(seed=3), out)


def test_bad_sources_are_refused(tmp_path: Path, stock: Path) -> None:
    with pytest.raises(FileNotFoundError):
        lightning_frozen.convert_deepspeed_checkpoint(tmp_path / "nothing", tmp_path / "out.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointFormatError, match="does not look like a DeepSpeed checkpoint"):
        lightning_frozen.convert_deepspeed_checkpoint(tmp_path / "empty", tmp_path / "out.ckpt")
    ours = tmp_path / "ours.ckpt"
    ours.write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match="is a file"):
        lightning_frozen.convert_deepspeed_checkpoint(ours, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()


def test_convert_on_the_command_line_takes_the_module_a_peft_export_needs(tmp_path: Path) -> None:
    from lightning_frozen.cli import main
    from tests.peft_models import PeftModule, batches

    trainer = cpu_trainer(StockDeepSpeedOnCPU(stage=3), max_steps=2)
    trainer.fit(PeftModule("lora_modules_to_save"), batches("lora_modules_to_save"))
    trainer.save_checkpoint(tmp_path / "stock.ckpt")

    main(["convert", str(tmp_path / "stock.ckpt"), str(tmp_path / "plain.ckpt")])
    with pytest.raises(CheckpointFormatError, match="was not trained on a PEFT model"):
        lightning_frozen.export_peft_adapter(tmp_path / "plain.ckpt", tmp_path / "refused")

    module = "tests.peft_models.PeftModule"
    main(["convert", str(tmp_path / "stock.ckpt"), str(tmp_path / "adapter.ckpt"), "--module", module])
    main(["export-peft", str(tmp_path / "adapter.ckpt"), str(tmp_path / "peft")])
    assert (tmp_path / "peft" / "adapter_config.json").is_file()
    assert "tiny-bert" in torch.load(tmp_path / "adapter.ckpt", weights_only=True)["frozen_base"]["reference"]
