"""The module's anatomy (``lightning_frozen/anatomy.py``): found once per setup and again when what trains changes,
and read by a save instead of walking the module for its PEFT model, adapters, trained copies and base references."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_frozen
from lightning_frozen import anatomy
from tests.models import BackboneModel, cpu_trainer

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from tests.peft_models import PeftModule, batches, tiny_bert_folder  # noqa: E402

# walks of the whole module in a save with the anatomy found at setup: the trainable state (its params and buffers),
# the optimizer state, the fingerprint's frozen params, the frozen params' storage, the buffers' names for the export
# entry, and PEFT's own `get_peft_model_state_dict` (3 for LoRA with `modules_to_save`); 20 before the anatomy
SAVE_WALKS = 9


def _recorded_builds(monkeypatch: pytest.MonkeyPatch) -> list[anatomy.Anatomy]:
    built: list[anatomy.Anatomy] = []
    find = anatomy.anatomy_of

    def recording(module: nn.Module, explicit_reference: Any = None) -> anatomy.Anatomy:
        built.append(find(module, explicit_reference))
        return built[-1]

    monkeypatch.setattr(anatomy, "anatomy_of", recording)
    return built


@contextmanager
def _counted_walks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count the outermost ``named_modules`` calls (``modules()``, ``named_parameters()`` ... call it too)."""
    walks, depth = [0], [0]
    original = nn.Module.named_modules

    def counting(self: nn.Module, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        walks[0] += depth[0] == 0
        depth[0] += 1
        try:
            yield from original(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    with monkeypatch.context() as patch:
        patch.setattr(nn.Module, "named_modules", counting)
        yield walks


class SaveCounted(L.Callback):
    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch, builds: list[anatomy.Anatomy]) -> None:
        self.path, self.monkeypatch, self.builds = path, monkeypatch, builds
        self.walks, self.builds_in_save = -1, -1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            before = len(self.builds)
            with _counted_walks(self.monkeypatch) as walks:
                trainer.save_checkpoint(self.path)
            self.walks, self.builds_in_save = walks[0], len(self.builds) - before


def test_a_save_in_a_run_reads_the_anatomy_found_at_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = _recorded_builds(monkeypatch)
    counted = SaveCounted(tmp_path / "run.ckpt", monkeypatch, builds)
    module = PeftModule("lora_modules_to_save")
    cpu_trainer(max_steps=2, callbacks=[counted]).fit(module, batches("lora_modules_to_save"))
    assert len(builds) == 1 and counted.builds_in_save == 0
    assert counted.walks <= SAVE_WALKS, counted.walks
    found = builds[0]
    assert found.peft is not None and found.peft[0] == "model" and found.trained_adapters == ("default",)
    assert "model.base_model.model.classifier.original_module.weight" in found.trained_copies
    assert found.base_reference == str(tiny_bert_folder())
    # what the record said is what the file holds: the export entry and the fingerprint without the originals
    saved = lightning_frozen.read_checkpoint(tmp_path / "run.ckpt")
    assert set(saved["frozen_base"]["peft"]["keys"]) <= set(found.trainable)
    assert not found.trained_copies & set(saved["frozen_base"]["fingerprint"]["tensors"])


def test_unfreezing_finds_the_anatomy_again(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = _recorded_builds(monkeypatch)
    finetuning = lightning_frozen.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.005)
    data = DataLoader(TensorDataset(torch.randn(16, 16), torch.randn(16, 1)), batch_size=8)
    cpu_trainer(max_epochs=2, callbacks=[finetuning]).fit(BackboneModel(), data)
    assert [found.trainable for found in builds] == [
        ("head.weight", "head.bias"),
        ("backbone.0.weight", "backbone.0.bias", "backbone.2.weight", "backbone.2.bias", "head.weight", "head.bias"),
    ]


# walks of the module in `load_adapter(..., adapter=...)`: its anatomy (one walk of the modules, one of the params),
# the frozen params the fingerprint verifies, the params and the persistent buffers the state is copied into, and
# setting the active adapter; 11 when the PEFT model was found again for each of the adapter, the trained copies and
# the active adapter
LOAD_WALKS = 7


def test_loading_one_adapter_walks_the_module_once_for_its_anatomy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = cpu_trainer(max_steps=1)
    trainer.fit(PeftModule("lora_modules_to_save"), batches("lora_modules_to_save"))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    builds = _recorded_builds(monkeypatch)
    module = PeftModule("lora_modules_to_save")
    with _counted_walks(monkeypatch) as walks:
        lightning_frozen.load_adapter(module, tmp_path / "run.ckpt", adapter="default")
    assert len(builds) == 1 and walks[0] <= LOAD_WALKS, walks[0]
    saved = lightning_frozen.read_checkpoint(tmp_path / "run.ckpt")["state_dict"]
    params = dict(module.named_parameters())
    assert saved and saved.keys() <= params.keys(), sorted(saved.keys() - params.keys())
    assert all(torch.equal(params[name], value) for name, value in saved.items())
