"""The adapter checkpoint file in one process: format, size, exact resume, base verification, loading paths,
ModelCheckpoint, atomic writes and bad files."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_frozen
from lightning_frozen.checkpoint import file
from lightning_frozen.errors import CheckpointFormatError, CheckpointKeysError, FrozenBaseMismatchError
from lightning_frozen.format import layout
from tests.models import AdapterModel, cpu_trainer, regression_data

TRAINABLE = ["head.bias", "head.weight", "layers.0.lora_a", "layers.0.lora_b", "layers.1.lora_a", "layers.1.lora_b"]


def _scheduled(module: AdapterModel) -> Any:
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit(tmp: Path, name: str, max_epochs: int, resume: Path | None = None, **model_kwargs: Any) -> Path:
    model = AdapterModel(optimizer_fn=_scheduled, **model_kwargs)
    trainer = cpu_trainer(max_epochs=max_epochs)
    trainer.fit(model, regression_data(), ckpt_path=resume)
    path = tmp / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One epoch, two epochs straight, and one epoch + a resumed second one."""
    tmp = tmp_path_factory.mktemp("ckpt")
    one = _fit(tmp, "one", 1)
    return {"one": one, "two": _fit(tmp, "two", 2), "resumed": _fit(tmp, "resumed", 2, resume=one)}


def test_one_weights_only_file_with_trainable_state_only(trained: dict[str, Path]) -> None:
    checkpoint = torch.load(trained["one"], weights_only=True)
    for key in ("epoch", "global_step", "loops", "callbacks", "lr_schedulers", "hyper_parameters", "state_dict"):
        assert key in checkpoint, key
    assert sorted(checkpoint["state_dict"]) == TRAINABLE
    assert all(value.dtype == torch.float32 for value in checkpoint["state_dict"].values())
    optimizer = checkpoint["optimizer_states"][0]
    assert optimizer["layout"] == "by_name" and sorted(optimizer["state"]) == TRAINABLE
    assert sorted(optimizer["state"]["layers.0.lora_a"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert optimizer["state"]["layers.0.lora_a"]["exp_avg"].shape == (4, 32)
    frozen = checkpoint["frozen_base"]
    assert frozen["reference"] == "tests/adapter-model"
    assert frozen["fingerprint"]["mode"] == "checksum"
    assert sorted(frozen["fingerprint"]["tensors"]) == [
        "layers.0.base.bias",
        "layers.0.base.weight",
        "layers.1.base.bias",
        "layers.1.base.weight",
    ]
    assert checkpoint["hyper_parameters"]["width"] == 32


def test_size_is_near_the_floor_of_twelve_bytes_per_trainable_param(tmp_path: Path) -> None:
    model = AdapterModel(width=256, rank=16)
    trainer = cpu_trainer(max_steps=1)
    trainer.fit(model, regression_data(width=256))
    path = tmp_path / "wide.ckpt"
    trainer.save_checkpoint(path)
    trainable = sum(p.ds_numel for p in model.parameters() if p.requires_grad)
    frozen = sum(p.ds_numel for p in model.parameters() if not p.requires_grad)
    floor = 12 * trainable
    size = path.stat().st_size
    # within 10% of the floor plus a small constant (loops, callbacks, fingerprint, pickle framing)
    assert size <= 1.10 * floor + 24_000, (size, floor)
    assert size < 4 * frozen  # the frozen base (fp32) is not in it


def test_resume_is_exact(trained: dict[str, Path]) -> None:
    straight = torch.load(trained["two"], weights_only=True)
    resumed = torch.load(trained["resumed"], weights_only=True)
    assert straight["global_step"] == resumed["global_step"] == 16
    for name in TRAINABLE:
        torch.testing.assert_close(resumed["state_dict"][name], straight["state_dict"][name])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                resumed["optimizer_states"][0]["state"][name][key], straight["optimizer_states"][0]["state"][name][key]
            )
    assert resumed["lr_schedulers"][0]["last_epoch"] == straight["lr_schedulers"][0]["last_epoch"]


def test_resume_onto_another_base_is_refused(trained: dict[str, Path]) -> None:
    model = AdapterModel(optimizer_fn=_scheduled)
    with torch.no_grad():
        model.layers[1].base.weight[3, 7] += 0.5
    with pytest.raises(FrozenBaseMismatchError, match=r"'tests/adapter-model'.*`layers\.1\.base\.weight`"):
        cpu_trainer(max_epochs=2).fit(model, regression_data(), ckpt_path=trained["one"])


def test_load_adapter_without_deepspeed_matches_the_checkpoint(trained: dict[str, Path]) -> None:
    checkpoint = torch.load(trained["two"], weights_only=True)
    module = lightning_frozen.load_adapter(AdapterModel(), trained["two"])
    for name, value in checkpoint["state_dict"].items():
        torch.testing.assert_close(module.get_parameter(name), value)
    assert not any(hasattr(p, "ds_id") for p in module.parameters())


def test_load_adapter_verifies_the_base_and_names_keys(trained: dict[str, Path]) -> None:
    with pytest.raises(FrozenBaseMismatchError, match="layers.0.base.bias.*layers.0.base.weight"):
        lightning_frozen.load_adapter(AdapterModel(seed=7), trained["one"])
    lightning_frozen.load_adapter(AdapterModel(seed=7), trained["one"], verify_base=False)

    wider = AdapterModel(rank=5)  # draws its random numbers differently, so its base differs as well
    with pytest.raises(FrozenBaseMismatchError, match=r"layers\.1\.base"):
        lightning_frozen.load_adapter(wider, trained["one"])
    with pytest.raises(CheckpointKeysError, match=r"layers\.0\.lora_a.*shape"):
        lightning_frozen.load_adapter(wider, trained["one"], verify_base=False)

    extra = AdapterModel()
    extra.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(CheckpointKeysError, match="missing trainable parameters `extra`"):
        lightning_frozen.load_adapter(extra, trained["one"])


def test_load_from_checkpoint_builds_the_module_from_its_hyper_parameters(trained: dict[str, Path]) -> None:
    module = lightning_frozen.load_from_checkpoint(AdapterModel, trained["two"])
    assert not module.training
    checkpoint = torch.load(trained["two"], weights_only=True)
    torch.testing.assert_close(module.head.weight, checkpoint["state_dict"]["head.weight"])
    with pytest.raises(CheckpointKeysError, match="shape"):
        lightning_frozen.load_from_checkpoint(AdapterModel, trained["two"], rank=2, verify_base=False)


class _MixedAdapterModel(lightning_frozen.AdapterCheckpointMixin, AdapterModel):
    """What a user's module looks like once it opts in to Lightning's ``load_from_checkpoint``."""


def test_lightnings_own_load_from_checkpoint_reads_the_file_with_the_mixin(trained: dict[str, Path]) -> None:
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"layers.0.base.weight\""):
        AdapterModel.load_from_checkpoint(trained["two"])  # what Lightning does without the mixin

    module = _MixedAdapterModel.load_from_checkpoint(trained["two"], map_location="cpu", weights_only=True)

    assert type(module) is _MixedAdapterModel and not module.training
    checkpoint = torch.load(trained["two"], weights_only=True)
    for name, value in checkpoint["state_dict"].items():
        torch.testing.assert_close(module.get_parameter(name), value)
    with pytest.raises(CheckpointKeysError, match="shape"):
        _MixedAdapterModel.load_from_checkpoint(trained["two"], rank=2, verify_base=False)
    with pytest.raises(lightning_frozen.InvalidArgumentValueError, match="pass the hyper-parameters"):
        _MixedAdapterModel.load_from_checkpoint(trained["two"], hparams_file="hparams.yaml")
    with pytest.raises(lightning_frozen.InvalidArgumentTypeError, match="put the mixin first"):
        type("MixinLast", (AdapterModel, lightning_frozen.AdapterCheckpointMixin), {})


def test_validate_with_ckpt_path_under_the_strategy_uses_the_adapter(trained: dict[str, Path]) -> None:
    loaded = lightning_frozen.load_adapter(AdapterModel(), trained["two"]).eval()
    x, y = next(iter(regression_data(batch_size=64)))
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(loaded(x), y).item()
    metrics = cpu_trainer().validate(AdapterModel(), regression_data(batch_size=64), ckpt_path=trained["two"])
    assert metrics[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_model_checkpoint_writes_single_files(tmp_path: Path) -> None:
    top_k = ModelCheckpoint(
        dirpath=tmp_path / "topk", monitor="train_loss", save_top_k=2, every_n_train_steps=2, save_last=True
    )
    weights = ModelCheckpoint(dirpath=tmp_path / "weights", save_weights_only=True, every_n_train_steps=3)
    trainer = cpu_trainer(max_steps=8, callbacks=[top_k, weights], enable_checkpointing=True)
    trainer.fit(AdapterModel(), regression_data())
    written = sorted(p.name for p in (tmp_path / "topk").iterdir())
    assert "last.ckpt" in written and len(written) == 3, written
    for folder in ("topk", "weights"):
        for path in (tmp_path / folder).iterdir():
            assert path.is_file(), path
            checkpoint = torch.load(path, weights_only=True)
            assert sorted(checkpoint["state_dict"]) == TRAINABLE
    weights_only = torch.load(next((tmp_path / "weights").iterdir()), weights_only=True)
    assert "optimizer_states" not in weights_only and "frozen_base" in weights_only
    assert top_k.best_model_path and Path(top_k.best_model_path).is_file()


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    file.write_atomic({"value": torch.arange(4)}, path)
    before = path.read_bytes()

    def crash(obj: Any, handle: Any) -> None:
        handle.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        file.write_atomic({"value": torch.arange(8)}, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_bad_files_are_named_with_what_is_wrong(trained: dict[str, Path], tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.ckpt"
    for length in (2000, len(trained["one"].read_bytes()) // 2):  # cut early, cut late
        truncated.write_bytes(trained["one"].read_bytes()[:length])
        with pytest.raises(CheckpointFormatError, match="truncated.ckpt is truncated: it ends before the end of its"):
            lightning_frozen.load_adapter(AdapterModel(), truncated)

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    hostile = tmp_path / "hostile.ckpt"
    with open(hostile, "wb") as handle:
        torch.save({"state_dict": {}, "x": Payload()}, handle, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(CheckpointFormatError, match="hostile.ckpt.*pickled"):
        lightning_frozen.load_adapter(AdapterModel(), hostile)
    assert not (tmp_path / "pwned").exists()

    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": AdapterModel().state_dict()}, plain)
    with pytest.raises(CheckpointFormatError, match="plain.ckpt is not a lightning-frozen checkpoint.*plain Lightning"):
        lightning_frozen.load_adapter(AdapterModel(), plain)

    folder = tmp_path / "stock"
    (folder / "checkpoint").mkdir(parents=True)
    with pytest.raises(CheckpointFormatError, match="stock is a directory, not a checkpoint file"):
        lightning_frozen.load_adapter(AdapterModel(), folder)  # empty: no DeepSpeed shards to convert
    (folder / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="directory.*lightning-frozen convert"):
        lightning_frozen.load_adapter(AdapterModel(), folder)
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        lightning_frozen.load_adapter(AdapterModel(), tmp_path / "missing.ckpt")


def test_fingerprint_option_full_hash_or_none(tmp_path: Path) -> None:
    from lightning_frozen import FrozenAwareDeepSpeedStrategy

    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(fingerprint="sha256"), max_steps=1)
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(tmp_path / "sha.ckpt")
    assert torch.load(tmp_path / "sha.ckpt", weights_only=True)["frozen_base"]["fingerprint"]["mode"] == "sha256"
    other = AdapterModel()
    with torch.no_grad():
        other.layers[0].base.bias[0] += 1e-6  # below bf16 resolution: only the full hash sees it
    with pytest.raises(FrozenBaseMismatchError, match="sha256"):
        cpu_trainer(FrozenAwareDeepSpeedStrategy(fingerprint="sha256"), max_steps=2).fit(
            other, regression_data(), ckpt_path=tmp_path / "sha.ckpt"
        )
    unchecked = cpu_trainer(FrozenAwareDeepSpeedStrategy(fingerprint="none"), max_steps=1)
    unchecked.fit(AdapterModel(seed=5), regression_data(), ckpt_path=tmp_path / "sha.ckpt")
    unchecked.save_checkpoint(tmp_path / "unchecked.ckpt")
    saved = torch.load(tmp_path / "sha.ckpt", weights_only=True)["state_dict"]["head.weight"]
    torch.testing.assert_close(
        torch.load(tmp_path / "unchecked.ckpt", weights_only=True)["state_dict"]["head.weight"], saved
    )


def test_the_base_is_fingerprinted_once_per_run(trained: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    from lightning_frozen.base import fingerprint

    calls: list[int] = []
    real = fingerprint.fingerprint_base

    def counting(named: Any, mode: str = "checksum", loaded: Any = None, kernels: Any = None) -> dict:
        calls.append(len(named))
        return real(named, mode, loaded, kernels)

    monkeypatch.setattr(fingerprint, "fingerprint_base", counting)
    trainer = cpu_trainer(max_epochs=2)
    trainer.fit(AdapterModel(optimizer_fn=_scheduled), regression_data(), ckpt_path=trained["one"])
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    trainer.save_checkpoint(tmp_path / "b.ckpt")
    assert calls == [4]  # the resume check; both saves reuse it


@pytest.mark.slow
def test_resume_with_optimizer_offload_is_exact(tmp_path: Path) -> None:
    def fit(max_epochs: int, resume: Path | None = None) -> dict:
        trainer = cpu_trainer("frozen_deepspeed_offload", max_epochs=max_epochs)
        trainer.fit(AdapterModel(optimizer_fn=_scheduled), regression_data(), ckpt_path=resume)
        path = tmp_path / f"offload-{max_epochs}-{resume is not None}.ckpt"
        trainer.save_checkpoint(path)
        return {"path": path, "ckpt": torch.load(path, weights_only=True)}

    one = fit(1)
    straight, resumed = fit(2)["ckpt"], fit(2, resume=one["path"])["ckpt"]
    assert resumed["global_step"] == straight["global_step"] == 16
    for name in TRAINABLE:
        torch.testing.assert_close(resumed["state_dict"][name], straight["state_dict"][name])
        torch.testing.assert_close(
            resumed["optimizer_states"][0]["state"][name]["exp_avg"],
            straight["optimizer_states"][0]["state"][name]["exp_avg"],
        )


def test_creating_lazy_state_on_resume_leaves_weights_of_an_lr_ignoring_optimizer_as_saved(tmp_path: Path) -> None:
    from transformers.optimization import Adafactor

    def adafactor(module: AdapterModel) -> Any:
        # relative_step: Adafactor sets its own step size and ignores the group's `lr`; weight decay then moves weights
        # even with zero gradients
        return Adafactor(module.parameters(), lr=None, relative_step=True, warmup_init=False, weight_decay=0.1)

    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(AdapterModel(optimizer_fn=adafactor), regression_data())
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    # resuming at the end of the saved epoch trains no further: what is saved again must be what was loaded
    again = cpu_trainer(max_epochs=1)
    again.fit(AdapterModel(optimizer_fn=adafactor), regression_data(), ckpt_path=tmp_path / "one.ckpt")
    again.save_checkpoint(tmp_path / "again.ckpt")
    saved, reloaded = (torch.load(tmp_path / n, weights_only=True) for n in ("one.ckpt", "again.ckpt"))
    assert sorted(saved["optimizer_states"][0]["state"]["head.weight"]) == ["RMS", "exp_avg_sq", "step"]
    for name in TRAINABLE:
        torch.testing.assert_close(reloaded["state_dict"][name], saved["state_dict"][name], rtol=0, atol=0)
        for key, value in saved["optimizer_states"][0]["state"][name].items():
            torch.testing.assert_close(reloaded["optimizer_states"][0]["state"][name][key], value, rtol=0, atol=0)


def test_fsspec_urls_are_written_read_resumed_and_loaded(tmp_path: Path) -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    every_four = ModelCheckpoint(dirpath="memory://lf-test/run", every_n_train_steps=4, save_top_k=-1)
    trainer = cpu_trainer(max_epochs=1, callbacks=[every_four], enable_checkpointing=True)
    trainer.fit(AdapterModel(optimizer_fn=_scheduled), regression_data())
    trainer.save_checkpoint("memory://lf-test/one.ckpt")
    try:
        assert sorted(memory.ls("/lf-test/run", detail=False)) == [
            "/lf-test/run/epoch=0-step=4.ckpt",
            "/lf-test/run/epoch=0-step=8.ckpt",
        ]
        assert not (Path.cwd() / "memory:").exists()  # not a local folder named after the URL
        one = lightning_frozen.read_checkpoint("memory://lf-test/one.ckpt")
        assert sorted(one["state_dict"]) == TRAINABLE and one["global_step"] == 8

        resumed = cpu_trainer(max_epochs=2)
        resumed.fit(AdapterModel(optimizer_fn=_scheduled), regression_data(), ckpt_path="memory://lf-test/one.ckpt")
        assert resumed.global_step == 16
        with pytest.raises(FrozenBaseMismatchError, match="memory://lf-test/one.ckpt"):
            lightning_frozen.load_adapter(AdapterModel(seed=2), "memory://lf-test/one.ckpt")
        module = lightning_frozen.load_adapter(AdapterModel(), "memory://lf-test/one.ckpt")
        torch.testing.assert_close(module.head.weight.detach(), one["state_dict"]["head.weight"])
        with pytest.raises(lightning_frozen.CheckpointNotFoundError, match="memory://lf-test/none.ckpt"):
            lightning_frozen.read_checkpoint("memory://lf-test/none.ckpt")
        # conversion works on local folders only, and says so
        with pytest.raises(lightning_frozen.UnsupportedConfigurationError, match="memory://lf-test/one.ckpt is a URL"):
            lightning_frozen.convert_deepspeed_checkpoint("memory://lf-test/one.ckpt", tmp_path / "out.ckpt")
    finally:
        memory.rm("/lf-test", recursive=True)


def test_a_checkpoint_io_plugin_writes_and_reads_the_file(tmp_path: Path) -> None:
    from lightning.fabric.plugins import TorchCheckpointIO

    class RecordingIO(TorchCheckpointIO):
        calls: list[str] = []

        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            self.calls.append(f"save {Path(path).name} {storage_options}")
            super().save_checkpoint(checkpoint, path, storage_options=None)

        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
            self.calls.append(f"load {Path(path).name} weights_only={weights_only}")
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    trainer = cpu_trainer(max_steps=2, plugins=[RecordingIO()])
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(tmp_path / "io.ckpt", storage_options={"tag": 1})
    assert sorted(lightning_frozen.read_checkpoint(tmp_path / "io.ckpt")["state_dict"]) == TRAINABLE
    cpu_trainer(max_steps=3, plugins=[RecordingIO()]).fit(
        AdapterModel(), regression_data(), ckpt_path=tmp_path / "io.ckpt"
    )
    assert RecordingIO.calls == ["save io.ckpt {'tag': 1}", "load io.ckpt weights_only=True"]


def test_storage_options_need_a_checkpoint_io_plugin_and_a_plugin_writes_and_reads(tmp_path: Path) -> None:
    from lightning.fabric.plugins import TorchCheckpointIO

    class PluginIO(TorchCheckpointIO):
        pass

    assert file.user_checkpoint_io(TorchCheckpointIO()) is None  # Lightning's default: our atomic write
    with pytest.raises(lightning_frozen.InvalidArgumentTypeError, match="needs a `CheckpointIO` plugin"):
        file.user_checkpoint_io(TorchCheckpointIO(), storage_options={"tag": 1})
    plugin = PluginIO()
    assert file.user_checkpoint_io(plugin, storage_options={"tag": 1}) is plugin
    marked = {"state_dict": {"w": torch.ones(2)}, "frozen_base": {}, "lightning_frozen": layout.format_marker()}
    for name, io in (("atomic.ckpt", None), ("plugin.ckpt", plugin)):
        file.save({**marked, "folder": tmp_path}, tmp_path / name, io)
        loaded = file.load(tmp_path / name, io)
        assert torch.equal(loaded["state_dict"]["w"], torch.ones(2)) and loaded["folder"] == str(tmp_path)
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointFormatError, match="plain.ckpt is not a lightning-frozen checkpoint"):
        file.load(tmp_path / "plain.ckpt", plugin)
