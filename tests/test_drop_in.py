"""``FrozenAwareDeepSpeedStrategy`` in place of Lightning's ``DeepSpeedStrategy`` at stage 3: what stock does that
applies on the CPU holds here too (one process, real DeepSpeed on its CPU accelerator)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins import DeepSpeedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.errors import CheckpointFormatError, InvalidArgumentValueError
from lightning_frozen.zero import accelerator
from lightning_frozen.zero.engine import shard_device
from tests.distributed import LoggedLines, build_deepspeed_cpu_ops
from tests.models import AdapterModel, LoRALinear, cpu_trainer, regression_data

ENV = DeepSpeedStrategy.DEEPSPEED_ENV_VAR
STOCK_WORDS = "The provided path is not a valid DeepSpeed checkpoint"  # `_validate_checkpoint_directory`'s


def _parameters(cls: type) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]


# ---------------------------------------------------------------------------------------------- arguments


def test_stocks_parameters_come_first_in_its_order_and_ours_are_keyword_only() -> None:
    stock, ours = _parameters(DeepSpeedStrategy), _parameters(FrozenAwareDeepSpeedStrategy)
    assert [p.name for p in ours[: len(stock)]] == [p.name for p in stock]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in ours[: len(stock)])
    differ = {p.name for p, q in zip(stock, ours) if p.default != q.default}
    assert differ == {"stage"}  # 3 here, 2 there
    assert {p.kind for p in ours[len(stock) :]} == {inspect.Parameter.KEYWORD_ONLY}

    strategy = FrozenAwareDeepSpeedStrategy(None, True, 3, "cpu", True)
    assert strategy.remote_device == "cpu" and strategy.offload_optimizer and strategy.offload_frozen
    assert strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_a_misspelt_keyword_names_this_class() -> None:
    with pytest.raises(TypeError, match=r"^FrozenAwareDeepSpeedStrategy\.__init__\(\) got an unexpected .* 'stag'"):
        FrozenAwareDeepSpeedStrategy(stag=3)


# ---------------------------------------------------------------------------------------------- the config


def _write(path: Path, config: dict) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def test_the_config_from_the_environment_variable_is_read_and_a_stage_other_than_3_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage_3 = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 4321}, "train_micro_batch_size_per_gpu": 2}
    monkeypatch.setenv(ENV, _write(tmp_path / "stage3.json", stage_3))
    assert FrozenAwareDeepSpeedStrategy().config == stage_3

    stage_2 = _write(tmp_path / "stage2.json", {"zero_optimization": {"stage": 2}})
    monkeypatch.setenv(ENV, stage_2)
    with pytest.raises(InvalidArgumentValueError, match=rf"config file {stage_2} \(from `{ENV}`\) sets ZeRO stage 2"):
        FrozenAwareDeepSpeedStrategy()
    # `config=` wins over the variable, as in stock
    assert FrozenAwareDeepSpeedStrategy(config=stage_3).config["zero_optimization"]["reduce_bucket_size"] == 4321


# ---------------------------------------------------------------------------------------------- set-up


def test_the_environment_is_set_up_with_no_model_connected_as_stock_allows() -> None:
    strategy = FrozenAwareDeepSpeedStrategy(
        accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment()
    )
    assert strategy.lightning_module is None
    strategy.setup_environment()
    try:
        assert torch.distributed.is_initialized() and strategy.world_size == 1 and strategy.global_rank == 0
        assert get_accelerator()._name == "cpu"
    finally:
        strategy.teardown()


# ---------------------------------------------------------------------------------------------- checkpoint paths


@pytest.fixture
def stock_checkpoint(tmp_path: Path) -> Path:
    """The layout of a stock DeepSpeed checkpoint directory (Lightning's tag ``checkpoint``), its files empty."""
    folder = tmp_path / "epoch=0-step=2.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    (folder / "latest").write_text("checkpoint")
    return folder


def test_load_checkpoint_on_a_missing_path_is_a_file_not_found_error_with_stocks_hints(stock_checkpoint: Path) -> None:
    strategy = FrozenAwareDeepSpeedStrategy()
    missing = stock_checkpoint.parent / "nothing.ckpt"
    with pytest.raises(FileNotFoundError, match=rf"No checkpoint at {re.escape(str(missing))}: check the path\.$"):
        strategy.load_checkpoint(missing)
    # a name mistyped inside a stock checkpoint: its parent folder is named, as stock names it
    for missing in (stock_checkpoint / "checkpont", stock_checkpoint / "checkpoint" / "model_states.pt"):
        with pytest.raises(
            FileNotFoundError, match=rf"inside {re.escape(str(stock_checkpoint))}, a checkpoint .*stock"
        ):
            strategy.load_checkpoint(missing)


def test_load_checkpoint_on_a_folder_says_what_it_is(stock_checkpoint: Path) -> None:
    strategy = FrozenAwareDeepSpeedStrategy()
    parent = re.escape(str(stock_checkpoint))
    with pytest.raises(CheckpointFormatError, match=rf"^{parent} is a directory: a checkpoint written by .* convert"):
        strategy.load_checkpoint(stock_checkpoint)
    # no checkpoint at these paths: a FileNotFoundError, as stock raises, in stock's words and naming the fix
    for inside in (
        stock_checkpoint / "checkpoint",
        stock_checkpoint / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
    ):
        with pytest.raises(FileNotFoundError, match=rf"^{STOCK_WORDS}: .*convert that parent .*convert {parent} "):
            strategy.load_checkpoint(inside)
    with pytest.raises(FileNotFoundError, match=rf"^{STOCK_WORDS}: .* is a directory, not a checkpoint file\. Pass"):
        strategy.load_checkpoint(stock_checkpoint.parent)


def test_load_checkpoint_on_a_folder_holding_no_checkpoint_raises_as_lightnings_own_test_expects(
    tmp_path: Path,
) -> None:
    # the first case of Lightning's `test_deepspeed_load_checkpoint_validate_path` (tests_pytorch), as it is written
    strategy = FrozenAwareDeepSpeedStrategy()
    with pytest.raises(FileNotFoundError, match="The provided path is not a valid DeepSpeed checkpoint"):
        strategy.load_checkpoint(checkpoint_path=tmp_path)
    # and still the package's own error, which callers caught for a folder before
    with pytest.raises(CheckpointFormatError, match=rf"{re.escape(str(tmp_path))} is a directory, not a checkpoint"):
        strategy.load_checkpoint(checkpoint_path=tmp_path)


# ---------------------------------------------------------------------------------------------- configure_model


class _BuiltInConfigureModel(AdapterModel):
    """The adapter model's layers built in ``configure_model``, under the strategy's ``zero.Init``; what each param
    was at creation is recorded."""

    def __init__(self) -> None:
        super().__init__()
        del self.layers
        self.created: dict[str, tuple[bool, str]] = {}

    def configure_model(self) -> None:
        if hasattr(self, "layers"):
            return
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(LoRALinear(32, 4) for _ in range(2))
        self.created = {
            name: (hasattr(p, "ds_id"), p.ds_tensor.device.type) for name, p in self.layers.named_parameters()
        }


class _Placement(Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        engine = trainer.strategy.deepspeed_engine
        self.offload_param, self.offload_optimizer = engine.zero_offload_param(), engine.zero_offload_optimizer()
        self.final = {name: p.ds_tensor.final_location for name, p in module.named_parameters()}
        self.fp32 = {flat.device.type for flat in engine.optimizer.fp32_partitioned_groups_flat}


def test_configure_model_builds_zero3_shards_and_only_frozen_ones_stay_offloaded() -> None:
    model, placement = _BuiltInConfigureModel(), _Placement()
    cpu_trainer(max_steps=2, callbacks=[placement]).fit(model, regression_data())
    # created as ZeRO-3 shards in CPU memory (`zero.Init(remote_device="cpu")`), trainable ones included
    assert model.created and set(model.created.values()) == {(True, "cpu")}
    # DeepSpeed offloads nothing itself: its config has no `offload_param`, no shard a final location elsewhere
    assert not placement.offload_param and not placement.offload_optimizer
    assert set(placement.final.values()) == {None} and placement.fp32 == {"cpu"}  # the accelerator's device here
    # the CPU accelerator's device is the CPU: on CUDA each shard goes to (tests/test_cuda.py runs it there)
    cuda = torch.device("cuda", 0)
    where = {name: shard_device(p, cuda, offload_frozen=True).type for name, p in model.layers.named_parameters()}
    assert where == {name: "cuda" if p.requires_grad else "cpu" for name, p in model.layers.named_parameters()}
    assert set(where.values()) == {"cuda", "cpu"}


# ---------------------------------------------------------------------------------------------- what stock fills in


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "bf16-true", "32-true"])
def test_each_precision_fills_the_config_as_stock_does(precision: str) -> None:
    options = dict(precision_plugin=DeepSpeedPrecision(precision), initial_scale_power=4, loss_scale_window=7)
    ours, stock = FrozenAwareDeepSpeedStrategy(**options), DeepSpeedStrategy(stage=3, **options)
    for strategy in (ours, stock):
        strategy._init_config_if_needed()
    assert ours.config == stock.config
    if precision == "16-mixed":
        assert ours.config["fp16"] == {
            "enabled": True, "loss_scale": 0, "initial_scale_power": 4, "loss_scale_window": 7, "hysteresis": 2,
            "min_loss_scale": 1,
        }  # fmt: skip
    assert ("bf16" in ours.config) == precision.startswith("bf16") and ("fp16" in ours.config) == (
        precision == "16-mixed"
    )


class _Config(Callback):
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.config = dict(trainer.strategy.config)


def test_the_batch_size_accumulation_and_clipping_come_from_the_trainer_and_its_dataloader() -> None:
    seen = _Config()
    trainer = cpu_trainer(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5, callbacks=[seen])
    trainer.fit(AdapterModel(), regression_data(batch_size=4))
    assert seen.config["train_micro_batch_size_per_gpu"] == 4  # `logging_batch_size_per_gpu="auto"`
    assert seen.config["gradient_accumulation_steps"] == 2 and seen.config["gradient_clipping"] == 0.5
    given = cpu_trainer(FrozenAwareDeepSpeedStrategy(logging_batch_size_per_gpu=3), max_steps=1, callbacks=[seen])
    given.fit(AdapterModel(), regression_data(batch_size=4))
    assert seen.config["train_micro_batch_size_per_gpu"] == 3


class _ClipsItself(AdapterModel):
    def configure_gradient_clipping(self, *args: object, **kwargs: object) -> None:
        """Overridden: what Lightning warns of under DeepSpeed, which clips by itself."""


@pytest.mark.parametrize("run", ["fit", "validate"])
def test_gradient_clipping_is_checked_as_stock_checks_it_for_training_and_evaluation(run: str) -> None:
    by_value = cpu_trainer(max_steps=1, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    with pytest.raises(MisconfigurationException, match="DeepSpeed does not support clipping gradients by value"):
        getattr(by_value, run)(AdapterModel(), regression_data())
    with pytest.warns(UserWarning, match="will not actually clip gradients"):
        getattr(cpu_trainer(max_steps=1), run)(_ClipsItself(), regression_data())


class _Hooked(AdapterModel):
    loaded: dict = {}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["user_state"] = {"seen": torch.arange(3), "note": "kept"}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.loaded = checkpoint["user_state"]


def test_the_modules_checkpoint_hooks_write_and_read_their_own_entries(tmp_path: Path) -> None:
    trainer = cpu_trainer(max_steps=2)
    trainer.fit(_Hooked(), regression_data())
    trainer.save_checkpoint(tmp_path / "hooked.ckpt")
    resumed = _Hooked()
    cpu_trainer(max_steps=3).fit(resumed, regression_data(), ckpt_path=tmp_path / "hooked.ckpt")
    assert resumed.loaded["note"] == "kept" and torch.equal(resumed.loaded["seen"], torch.arange(3))


# ---------------------------------------------------------------------------------------------- stock's conversion

FAQ = Path(__file__).resolve().parent.parent / "docs" / "faq.md"


def test_stocks_conversion_of_our_file_fails_with_the_words_the_faq_starts_from(tmp_path: Path) -> None:
    """Lightning's documented ``convert_zero_checkpoint_to_fp32_state_dict`` reads a stock DeepSpeed folder; on our one
    file it fails, and docs/faq.md has an entry headed by that very message, whatever DeepSpeed says in a release."""
    trainer = cpu_trainer(max_steps=1)
    trainer.fit(AdapterModel(), regression_data())
    path = tmp_path / "epoch=0-step=1.ckpt"
    trainer.save_checkpoint(path)
    with pytest.raises(Exception) as caught:
        convert_zero_checkpoint_to_fp32_state_dict(path, tmp_path / "model.pt")
    seen = f"{type(caught.value).__name__}: {caught.value}".replace(str(path), "...")
    assert "Unable to find 'latest' file" in seen  # DeepSpeed's `zero_to_fp32`, so the test meets what a user meets
    headings = re.findall(r"^## (.+)$", FAQ.read_text(), re.M)
    assert f"`{seen}` from Lightning's `convert_zero_checkpoint_to_fp32_state_dict`" in headings, headings


# ---------------------------------------------------------------------------------------------- DeepSpeed's CPU op

SHM_NOTE = "lightning-frozen: DeepSpeed is compiling its shared-memory collectives for the CPU into"


def test_a_start_that_compiles_deepspeeds_shared_memory_op_says_so_first_and_one_that_loads_it_says_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning_log: LoggedLines
) -> None:
    build_deepspeed_cpu_ops()  # DeepSpeed keeps an op it loaded for the process: no fit here compiles one
    cpu_trainer(max_steps=1).fit(AdapterModel(), regression_data())
    assert [line for line in lightning_log.lines if SHM_NOTE in line] == []  # built in the suite's folder
    # a folder where nothing is built, as a first run meets it: said once, on rank 0, before DeepSpeed starts
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "fresh"))
    cpu_trainer(max_steps=1).fit(AdapterModel(), regression_data())
    assert [line for line in lightning_log.lines if SHM_NOTE in line] == [
        f"{SHM_NOTE} {tmp_path / 'fresh' / 'deepspeed_shm_comm'}, once: 30 s or more with no output (docs/faq.md)."
    ]
    # the folder holding another torch's build, which torch rebuilds (one default folder serves every venv)
    built = tmp_path / "other-torch" / "deepspeed_shm_comm"
    built.mkdir(parents=True)
    (built / "deepspeed_shm_comm.so").write_bytes(b"")
    (built / "build.ninja").write_text("cflags = -isystem /elsewhere/torch/include\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(built.parent))
    assert (accelerator.shared_memory_op_build_note() or "").startswith(SHM_NOTE)
