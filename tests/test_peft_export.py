"""The real pretrained model (all-MiniLM-L6-v2 from its wheel) with PEFT LoRA: train under ``frozen_deepspeed``,
find the base reference by itself, export to PEFT's format and load it back with ``PeftModel.from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_frozen
from lightning_frozen.errors import CheckpointFormatError
from tests.models import AdapterModel, cpu_trainer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from examples.minilm_lora.task import minilm_folder  # noqa: E402
from tests.peft_models import encoded, minilm_classifier  # noqa: E402


class MiniLMLoRA(L.LightningModule):
    def __init__(self, lr: float = 5e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = peft.LoraConfig(
            task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"]
        )
        self.model = peft.get_peft_model(minilm_classifier(), config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        return torch.nn.functional.cross_entropy(self(input_ids, attention_mask), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("peft")
    module = MiniLMLoRA()
    lora = sum(p.numel() for n, p in module.named_parameters() if p.requires_grad and "lora_" in n)
    trainer = cpu_trainer(max_steps=4)
    trainer.fit(module, DataLoader(TensorDataset(*encoded()), batch_size=4))
    path = tmp / "adapter.ckpt"
    trainer.save_checkpoint(path)
    return {"path": path, "tmp": tmp, "lora_numel": lora}


def test_lora_on_query_and_value_trains_36864_params(trained: dict[str, Any]) -> None:
    assert trained["lora_numel"] == 36_864
    state = torch.load(trained["path"], weights_only=True)["state_dict"]
    assert sum(v.numel() for k, v in state.items() if "lora_" in k) == 36_864
    assert all("lora_" in k or "modules_to_save" in k for k in state)


def test_the_base_reference_is_found_from_peft(trained: dict[str, Any]) -> None:
    frozen_base = torch.load(trained["path"], weights_only=True)["frozen_base"]
    assert frozen_base["reference"] == str(minilm_folder())
    assert frozen_base["peft"]["config"]["peft_type"] == "LORA"
    assert sorted(frozen_base["peft"]["config"]["target_modules"]) == ["query", "value"]


def test_exported_adapter_loads_in_peft_to_the_same_outputs(trained: dict[str, Any]) -> None:
    out = lightning_frozen.export_peft_adapter(trained["path"], trained["tmp"] / "export")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4

    ours = lightning_frozen.load_adapter(MiniLMLoRA(), trained["path"]).eval()
    theirs = peft.PeftModel.from_pretrained(minilm_classifier(), str(out)).eval()
    untrained = minilm_classifier().eval()
    input_ids, attention_mask, _ = encoded()
    with torch.no_grad():
        expected = ours(input_ids, attention_mask)
        got = theirs(input_ids=input_ids, attention_mask=attention_mask).logits
        before = untrained(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(
        before, expected, atol=1e-4
    )  # training changed the outputs: the comparison means something


def test_export_of_a_checkpoint_without_peft_says_so(tmp_path: Path) -> None:
    trainer = cpu_trainer(max_steps=1)
    trainer.fit(AdapterModel(), DataLoader(TensorDataset(torch.randn(8, 32), torch.randn(8, 1)), batch_size=4))
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointFormatError, match="plain.ckpt was not trained on a PEFT model"):
        lightning_frozen.export_peft_adapter(tmp_path / "plain.ckpt", tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        lightning_frozen.export_peft_adapter(tmp_path / "plain.ckpt", tmp_path / "file")


def test_a_crash_between_the_weights_and_the_config_leaves_the_previous_export_whole(
    trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = trained["tmp"] / "replaced"
    lightning_frozen.export_peft_adapter(trained["path"], out)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    (out / "adapter_config.json").write_text('{"r": 4, "marker": "previous run"}')  # tell the old folder apart
    before["adapter_config.json"] = (out / "adapter_config.json").read_bytes()

    real_write_text = Path.write_text

    def crash_at_the_config(self: Path, *args: Any, **kwargs: Any) -> int:
        if self.name == "adapter_config.json":
            assert (self.parent / "adapter_model.safetensors").exists()  # the weights were written: between the two
            raise OSError("injected crash between the weights and the config")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", crash_at_the_config)
    with pytest.raises(OSError, match="injected crash"):
        lightning_frozen.export_peft_adapter(trained["path"], out)
    monkeypatch.undo()
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temp folder left

    lightning_frozen.export_peft_adapter(trained["path"], out)  # an earlier export is replaced whole
    assert "marker" not in json.loads((out / "adapter_config.json").read_text())


def test_an_export_into_a_folder_holding_other_files_is_refused(trained: dict[str, Any]) -> None:
    out = trained["tmp"] / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(NotADirectoryError, match="busy holds notes.txt, which an export does not write"):
        lightning_frozen.export_peft_adapter(trained["path"], out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
