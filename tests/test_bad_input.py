"""Bad input to every public function and strategy option: each gets an error or warning that names the thing at
fault and the fix, and nothing on disk is lost."""

from __future__ import annotations

import os
import re
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from torch import nn

import lightning_frozen
from lightning_frozen import (
    CheckpointFormatError,
    CheckpointKeysError,
    CheckpointNotFoundError,
    FrozenAwareDeepSpeedStrategy,
    FrozenBaseMismatchError,
    NoTrainableParametersError,
)
from lightning_frozen.checkpoint.file import read_checkpoint
from tests.models import AdapterModel, StockDeepSpeedOnCPU, cpu_trainer, regression_data


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An adapter checkpoint, a stock DeepSpeed directory, a plain Lightning file, other files that are no
    checkpoints, a logs folder (``runs``) and a folder of checkpoints (``checkpoints``)."""
    tmp = tmp_path_factory.mktemp("inputs")
    trainer = cpu_trainer(max_steps=2)
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(tmp / "adapter.ckpt")
    stock = cpu_trainer(StockDeepSpeedOnCPU(stage=3), max_steps=1)
    stock.fit(AdapterModel(), regression_data())
    stock.save_checkpoint(tmp / "stock.ckpt")
    torch.save({"state_dict": AdapterModel().state_dict(), "epoch": 0}, tmp / "plain.ckpt")
    (tmp / "empty.ckpt").write_bytes(b"")
    (tmp / "notes.ckpt").write_text("hello")
    torch.save(torch.zeros(3), tmp / "tensor.ckpt")
    (tmp / "runs" / "lightning_logs" / "version_0").mkdir(parents=True)
    (tmp / "runs" / "lightning_logs" / "version_0" / "hparams.yaml").write_text("width: 32\n")
    (tmp / "checkpoints").mkdir()
    (tmp / "checkpoints" / "epoch=0-step=2.ckpt").write_bytes((tmp / "adapter.ckpt").read_bytes())
    return {path.stem: path for path in tmp.iterdir()}


@pytest.fixture
def unreadable(tmp_path: Path) -> Path:
    """A file that exists but cannot be read: mode 000, or for root (whom modes do not stop) the process's memory."""
    if os.geteuid() == 0:
        return Path("/proc/self/mem")
    path = tmp_path / "locked.ckpt"
    path.write_bytes(b"x")
    path.chmod(0)
    return path


# ---------------------------------------------------------------------------------------------- strategy options


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (dict(offload_frozen="no"), "`offload_frozen` must be True or False, got 'no'"),
        (dict(convert_lr_zero_groups=1), "`convert_lr_zero_groups` must be True or False"),
        (dict(offload_optimizer=None), "`offload_optimizer` must be True or False"),
        (dict(timeout=60), r"`timeout` must be a `datetime.timedelta`, e.g. `timedelta\(minutes=10\)`, got 60"),
        (dict(frozen_base=7), "`frozen_base` must be the base's path or hub id, got 7"),
        (dict(config=3), "`config` must be a DeepSpeed config dict or the path of its JSON file, got 3"),
        (dict(stage="3"), r"`stage` must be the int 3 \(ZeRO stage 3 shards frozen params\), got '3'"),
        (dict(generation_memory=2.5), r"`generation_memory` must be a number of bytes, a size such as '20GB'"),
    ],
)
def test_strategy_options_of_the_wrong_type_are_named(option: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        FrozenAwareDeepSpeedStrategy(**option)


def test_strategy_option_values_are_named_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"got `stage=2`.*DeepSpeedStrategy"):
        FrozenAwareDeepSpeedStrategy(stage=2)
    with pytest.raises(ValueError, match="`fingerprint='md5'` is not one of"):
        FrozenAwareDeepSpeedStrategy(fingerprint="md5")
    with pytest.raises(ValueError, match=r"`generation_memory='20 parsecs'` is not a size: .* e.g. '20GB'"):
        FrozenAwareDeepSpeedStrategy(generation_memory="20 parsecs")
    with pytest.raises(ValueError, match="`generation_memory` must allow at least 1 byte, got 0"):
        FrozenAwareDeepSpeedStrategy(generation_memory=0)
    sizes = {"20GB": 20 * 10**9, "1.5 GiB": 3 * 2**29, "512mib": 512 * 2**20, 7: 7, "auto": None}
    assert {
        size: FrozenAwareDeepSpeedStrategy(generation_memory=size).spec.generation_memory for size in sizes
    } == sizes
    config = {"zero_optimization": {"stage": 3}}
    FrozenAwareDeepSpeedStrategy(frozen_base=Path("bases/bert"), timeout=timedelta(seconds=30), config=config)


# ---------------------------------------------------------------------------------------------- models


class NoParameters(L.LightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        return None

    def configure_optimizers(self) -> None:
        return None


class NothingFrozen(AdapterModel):
    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(True)


def test_an_empty_model_is_refused_before_deepspeed_starts() -> None:
    with pytest.raises(NoTrainableParametersError, match="`NoParameters` has no parameters at all"):
        cpu_trainer(max_steps=1).fit(NoParameters(), regression_data())


def test_a_model_with_nothing_frozen_trains_and_is_warned(tmp_path: Path) -> None:
    model = NothingFrozen()
    before = model.layers[0].base.weight.detach().clone()
    trainer = cpu_trainer(max_steps=2)
    with pytest.warns(UserWarning, match=r"every parameter of `NothingFrozen` is trainable.*deepspeed_stage_3"):
        trainer.fit(model, regression_data())
    trainer.save_checkpoint(tmp_path / "all.ckpt")
    saved = read_checkpoint(tmp_path / "all.ckpt")
    assert "layers.0.base.weight" in saved["state_dict"] and not saved["frozen_base"]["fingerprint"]["tensors"]
    assert not torch.equal(saved["state_dict"]["layers.0.base.weight"], before)
    loaded = lightning_frozen.load_adapter(NothingFrozen(), tmp_path / "all.ckpt")
    torch.testing.assert_close(loaded.layers[0].base.weight, saved["state_dict"]["layers.0.base.weight"])


def test_a_mostly_frozen_model_is_not_warned() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is trainable")
        cpu_trainer(max_steps=1).fit(AdapterModel(), regression_data())


# ---------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize(
    "call",
    [
        lambda path: lightning_frozen.load_adapter(AdapterModel(), path),
        lambda path: lightning_frozen.load_from_checkpoint(AdapterModel, path),
        lambda path: lightning_frozen.export_peft_adapter(path, Path(os.devnull).parent / "never-written"),
        lightning_frozen.read_checkpoint,
    ],
    ids=["load_adapter", "load_from_checkpoint", "export_peft_adapter", "read_checkpoint"],
)
def test_every_load_path_names_what_is_wrong_with_the_file(call: Any, files: dict[str, Path], unreadable: Path) -> None:
    with pytest.raises(TypeError, match=r"`checkpoint_path` must be a file system path.*got 3|`path` must be.*got 3"):
        call(3)
    with pytest.raises(FileNotFoundError, match="No checkpoint at .*missing.ckpt"):
        call(files["adapter"].parent / "missing.ckpt")
    with pytest.raises(CheckpointFormatError, match=r"stock.ckpt is a directory.*lightning-frozen convert"):
        call(files["stock"])
    with pytest.raises(CheckpointFormatError, match=r"runs is a directory, not a checkpoint file\. Pass") as refused:
        call(files["runs"])
    assert "convert" not in str(refused.value) and "holds" not in str(refused.value)
    with pytest.raises(CheckpointFormatError, match=r"checkpoints is a directory.*It holds `epoch=0-step=2\.ckpt`"):
        call(files["checkpoints"])
    shard = next(files["stock"].glob("checkpoint/*model_states.pt"))
    with pytest.raises(CheckpointFormatError, match="model_states.pt is not a lightning-frozen checkpoint"):
        call(shard)
    with pytest.raises(CheckpointFormatError, match=r"plain.ckpt .*plain Lightning checkpoint.*without `ckpt_path`"):
        call(files["plain"])
    for name in ("empty", "notes"):
        with pytest.raises(CheckpointFormatError, match=rf"{name}.ckpt is not a readable checkpoint"):
            call(files[name])
    with pytest.raises(CheckpointFormatError, match="tensor.ckpt holds a Tensor, not a checkpoint dict"):
        call(files["tensor"])
    with pytest.raises(CheckpointFormatError, match=f"{unreadable} cannot be read"):
        call(unreadable)
    assert not (Path(os.devnull).parent / "never-written").exists()


def test_load_adapter_arguments_the_wrong_way_round(files: dict[str, Path]) -> None:
    with pytest.raises(TypeError, match="`module` must be a torch.nn.Module, got PosixPath"):
        lightning_frozen.load_adapter(files["adapter"], AdapterModel())  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match="`cls` must be the module class.*got an instance of `AdapterModel`.*use `lightning_frozen.load_adapter",
    ):
        lightning_frozen.load_from_checkpoint(AdapterModel(), files["adapter"])  # type: ignore[arg-type]


def test_a_checkpoint_of_another_model(files: dict[str, Path]) -> None:
    class Probe(nn.Module):
        def __init__(self, classes: int = 2) -> None:
            super().__init__()
            self.linear = nn.Linear(4, classes)

    with pytest.raises(TypeError, match=r"`Probe` cannot be built from the hyper-parameters saved in .*adapter.ckpt"):
        lightning_frozen.load_from_checkpoint(Probe, files["adapter"])
    with pytest.raises(FrozenBaseMismatchError, match=r"'tests/adapter-model'.*`layers\.2\.base\.bias`"):
        lightning_frozen.load_adapter(AdapterModel(depth=3), files["adapter"])
    with pytest.raises(FrozenBaseMismatchError, match="layers.0.base"):
        cpu_trainer(max_steps=3).fit(AdapterModel(seed=4), regression_data(), ckpt_path=files["adapter"])


def test_a_refused_load_leaves_the_module_as_it_was(files: dict[str, Path]) -> None:
    # width 32, rank 4 saved; rank 5 changes the LoRA shapes but `head` still matches and comes first by name
    module = AdapterModel(rank=5)
    before = {name: value.clone() for name, value in module.state_dict().items()}
    with pytest.raises(CheckpointKeysError, match=r"`layers\.0\.lora_a` has shape \(4, 32\).*\(5, 32\)"):
        lightning_frozen.load_adapter(module, files["adapter"], verify_base=False)
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("source", ["plain", "stock"])
def test_resuming_from_a_foreign_checkpoint_says_what_to_do(files: dict[str, Path], source: str) -> None:
    fix = "plain Lightning checkpoint" if source == "plain" else "lightning-frozen convert"
    for run in ("fit", "validate"):
        trainer = cpu_trainer(max_steps=1)
        with pytest.raises(CheckpointFormatError, match=f"{source}.ckpt.*{fix}"):
            getattr(trainer, run)(AdapterModel(), regression_data(), ckpt_path=files[source])


class SetupRecorder(AdapterModel):
    """Records the stages of its ``setup`` hook, which Lightning calls after the strategy's ``setup_environment``
    and before ``configure_model`` and DeepSpeed."""

    def __init__(self) -> None:
        super().__init__()
        self.stages: list[str] = []

    def setup(self, stage: str) -> None:
        self.stages.append(stage)


def test_a_wrong_ckpt_path_is_refused_before_anything_is_set_up(files: dict[str, Path]) -> None:
    missing = files["adapter"].parent / "typo.ckpt"
    for run in ("fit", "validate"):
        model = SetupRecorder()
        with pytest.raises(
            CheckpointNotFoundError,
            match=re.escape(f"No checkpoint at {missing} (the `ckpt_path` of `{run}`): check the path."),
        ):
            getattr(cpu_trainer(max_steps=1), run)(model, regression_data(), ckpt_path=missing)
        assert model.stages == []
    model = SetupRecorder()
    with pytest.raises(
        CheckpointNotFoundError, match=rf"No checkpoint at typo.ckpt .*relative paths start at {re.escape(os.getcwd())}"
    ):
        cpu_trainer().validate(model, regression_data(), ckpt_path="typo.ckpt")
    with pytest.raises(CheckpointFormatError, match=r"stock.ckpt is a directory.*lightning-frozen convert"):
        cpu_trainer().validate(model, regression_data(), ckpt_path=files["stock"])
    with pytest.raises(CheckpointFormatError, match=r"runs is a directory, not a checkpoint file \(the `ckpt_path`"):
        cpu_trainer().validate(model, regression_data(), ckpt_path=files["runs"])
    assert model.stages == []


def test_the_ckpt_path_check_follows_lightnings_choice_and_leaves_plugins_alone(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    with pytest.warns(UserWarning, match=r'ckpt_path="last"\) is set, but there is no last checkpoint'):
        cpu_trainer(max_steps=1).fit(AdapterModel(), regression_data(), ckpt_path="last")
    # `trainer.ckpt_path` still names the previous run's file, since removed: this run restores none
    kept = tmp_path / "kept.ckpt"
    kept.write_bytes(files["adapter"].read_bytes())
    trainer = cpu_trainer()
    trainer.validate(AdapterModel(), regression_data(), ckpt_path=kept)
    kept.unlink()
    assert trainer.ckpt_path == kept
    trainer.validate(AdapterModel(), regression_data())

    class ByName(TorchCheckpointIO):
        """Reads a checkpoint by its name from another place, as a cloud storage plugin does."""

        read: list[str] = []

        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
            self.read.append(str(path))
            where = files["adapter"].parent / Path(path).name
            return super().load_checkpoint(where, map_location=map_location, weights_only=weights_only)

    cpu_trainer(plugins=[ByName()]).validate(AdapterModel(), regression_data(), ckpt_path="bucket/adapter.ckpt")
    assert ByName.read == ["bucket/adapter.ckpt"]


# ---------------------------------------------------------------------------------------------- writing


def test_saving_onto_a_directory_is_refused_and_the_directory_kept(tmp_path: Path, files: dict[str, Path]) -> None:
    target = tmp_path / "last.ckpt"
    shard = target / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"a stock shard")
    trainer = cpu_trainer(max_steps=1)
    trainer.fit(AdapterModel(), regression_data())
    with pytest.raises(CheckpointFormatError, match=r"last.ckpt is a directory \(a stock DeepSpeed checkpoint\)"):
        trainer.save_checkpoint(target)
    assert shard.read_bytes() == b"a stock shard"
    with pytest.raises(CheckpointFormatError, match="is a directory"):
        lightning_frozen.convert_deepspeed_checkpoint(files["stock"], target)
    assert shard.read_bytes() == b"a stock shard"
    with pytest.raises(CheckpointFormatError, match=r"logs is a directory; lightning-frozen writes one file"):
        trainer.save_checkpoint(files["runs"] / "lightning_logs")


def test_convert_names_bad_arguments_and_keeps_what_is_there(tmp_path: Path, files: dict[str, Path]) -> None:
    kept = tmp_path / "kept.ckpt"
    kept.write_bytes(files["adapter"].read_bytes())
    with pytest.raises(TypeError, match="`convert_deepspeed_checkpoint`: `source` must be a file system path"):
        lightning_frozen.convert_deepspeed_checkpoint(None, kept)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`destination` must be a file system path \(str or os.PathLike\), got None"):
        lightning_frozen.convert_deepspeed_checkpoint(files["stock"], None)  # type: ignore[arg-type]
    with pytest.raises(CheckpointFormatError, match="adapter.ckpt is a file.*needs no conversion"):
        lightning_frozen.convert_deepspeed_checkpoint(files["adapter"], kept)
    broken = tmp_path / "broken"
    (broken / "checkpoint").mkdir(parents=True)
    for shard in (files["stock"] / "checkpoint").iterdir():
        (broken / "checkpoint" / shard.name).write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointFormatError, match="broken has a shard file that cannot be read"):
        lightning_frozen.convert_deepspeed_checkpoint(broken, kept)
    assert kept.read_bytes() == files["adapter"].read_bytes()


def test_export_names_bad_arguments(tmp_path: Path, files: dict[str, Path]) -> None:
    with pytest.raises(TypeError, match="`export_peft_adapter`: `output_dir` must be a file system path"):
        lightning_frozen.export_peft_adapter(files["adapter"], 5)  # type: ignore[arg-type]
    with pytest.raises(NotADirectoryError, match="notes.ckpt exists and is not a directory"):
        lightning_frozen.export_peft_adapter(files["adapter"], files["notes"])
    assert files["notes"].read_text() == "hello"
    with pytest.raises(CheckpointFormatError, match="adapter.ckpt was not trained on a PEFT model"):
        lightning_frozen.export_peft_adapter(files["adapter"], tmp_path / "out")


def test_estimate_memory_names_bad_arguments() -> None:
    with pytest.raises(TypeError, match="`estimate_memory`: `model` must be a torch.nn.Module.*got 'bert'"):
        lightning_frozen.estimate_memory("bert")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`num_devices` and `num_nodes` must be integers, got '2' and 1"):
        lightning_frozen.estimate_memory(AdapterModel(), num_devices="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_devices and num_nodes must be >= 1, got 0"):
        lightning_frozen.estimate_memory(AdapterModel(), num_devices=0)
    with pytest.raises(ValueError, match="Unknown precision 'fp8'"):
        lightning_frozen.estimate_memory(AdapterModel(), precision="fp8")
