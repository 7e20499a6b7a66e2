"""Resumes that must be exact beyond the plain loop: the loss scaler's state, gradient accumulation with a resume in
the middle of an epoch, manual optimization, tied weights, and tensors whose size is not a multiple of the world size
on two ranks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

import lightning_frozen
from lightning_frozen.base.fingerprint import fingerprint_base
from tests.distributed import chained, run_script
from tests.models import AdapterModel, cpu_trainer, regression_data


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _assert_same_training_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["global_step"] == b["global_step"]
    assert sorted(a["state_dict"]) == sorted(b["state_dict"])
    for name, value in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][name], value, rtol=0, atol=0)
        for key, state in a["optimizer_states"][0]["state"][name].items():
            torch.testing.assert_close(b["optimizer_states"][0]["state"][name][key], state, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- loss scaler


class DynamicLossScale(Callback):
    """Put DeepSpeed's own dynamic (fp16) loss scaler into the ZeRO optimizer of an fp32 run, which the CPU can train:
    it scales the loss by powers of two (exact in fp32) and counts iterations and overflows as under ``16-mixed``."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

        trainer.strategy.deepspeed_engine.optimizer.loss_scaler = DynamicLossScaler(
            init_scale=4.0, scale_window=3, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False
        )


def test_the_loss_scaler_state_is_saved_and_a_resume_continues_it(tmp_path: Path) -> None:
    def fit(max_epochs: int, name: str, resume: Path | None = None) -> Path:
        trainer = cpu_trainer(max_epochs=max_epochs, callbacks=[DynamicLossScale()])
        trainer.fit(AdapterModel(), regression_data(), ckpt_path=resume)
        trainer.save_checkpoint(tmp_path / name)
        return tmp_path / name

    one = fit(1, "one.ckpt")
    straight, resumed = _load(fit(2, "straight.ckpt")), _load(fit(2, "resumed.ckpt", resume=one))
    saved = _load(one)["optimizer_states"][0]["loss_scaler"]
    # 8 steps without overflow with a window of 3: the scale doubled twice
    assert saved == {"cur_scale": 16.0, "cur_iter": 8, "last_overflow_iter": -1, "cur_hysteresis": 2}
    assert resumed["optimizer_states"][0]["loss_scaler"] == straight["optimizer_states"][0]["loss_scaler"]
    assert straight["optimizer_states"][0]["loss_scaler"]["cur_iter"] == 16
    _assert_same_training_state(straight, resumed)


def test_a_loss_scale_this_run_does_not_keep_warns_that_it_starts_afresh() -> None:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from lightning_frozen.zero.params import restore_loss_scaler

    optimizer = SimpleNamespace(loss_scaler=LossScaler(1.0))  # a bf16 or fp32 run's static scaler
    saved = {"cur_scale": 16.0, "cur_iter": 8, "cur_hysteresis": 2}  # a 16-mixed run's
    with pytest.warns(UserWarning, match=r"`cur_iter`, `cur_hysteresis`, which this run's `LossScaler` does not keep"):
        restore_loss_scaler(optimizer, saved)
    assert optimizer.loss_scaler.cur_scale == 16.0


# ---------------------------------------------------------------------------------------------- accumulation


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader that Lightning can resume in the middle of an epoch (``state_dict`` / ``load_state_dict``).

    Without one, Lightning replays the epoch from its first batch after a mid-epoch resume (and says so), so no
    strategy could resume it exactly.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # Lightning builds it again with its own sampler
        self._drawn, self._skip = 0, 0

    def __iter__(self) -> Any:
        skip, self._skip = self._skip, 0
        self._drawn = skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self._drawn += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"next": self._drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["next"]


def test_gradient_accumulation_resumed_in_the_middle_of_an_epoch_is_exact(tmp_path: Path) -> None:
    def fit(folder: str, resume: Path | None = None) -> L.Trainer:
        every_three = ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=3, save_top_k=-1)
        trainer = cpu_trainer(
            max_epochs=2, accumulate_grad_batches=2, callbacks=[every_three], enable_checkpointing=True
        )
        trainer.fit(AdapterModel(), ResumableLoader(regression_data().dataset, batch_size=8), ckpt_path=resume)
        trainer.save_checkpoint(tmp_path / f"{folder}.ckpt")
        return trainer

    straight = fit("straight")
    assert straight.strategy.deepspeed_engine.gradient_accumulation_steps() == 2
    # 8 batches an epoch, 4 optimizer steps: step 3 is saved after batch 6 of the first epoch
    middle = tmp_path / "straight" / "epoch=0-step=3.ckpt"
    assert _load(middle)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] == 6
    fit("resumed", resume=middle)
    _assert_same_training_state(_load(tmp_path / "straight.ckpt"), _load(tmp_path / "resumed.ckpt"))
    assert _load(tmp_path / "straight.ckpt")["global_step"] == 8


# ---------------------------------------------------------------------------------------------- a chain of resumes


class EpochStarts(Callback):
    """Records each epoch that ``on_train_epoch_start`` saw, and the order the shuffled sampler gave it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen.append((trainer.current_epoch, list(trainer.train_dataloader.sampler)))


def test_a_run_resumed_from_a_resumed_runs_checkpoint_ends_bit_equal_to_one_never_stopped(tmp_path: Path) -> None:
    def fit(name: str, max_steps: int, resume: Path | None = None) -> EpochStarts:
        # a stop at a step boundary that ends an epoch (a preemption's `last.ckpt`): saved at the batch's end
        every_four = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=4, save_top_k=-1)
        epochs = EpochStarts()
        trainer = cpu_trainer(
            max_steps=max_steps, max_epochs=-1, callbacks=[every_four, epochs], enable_checkpointing=True
        )
        trainer.fit(AdapterModel(), regression_data(samples=16), ckpt_path=resume)  # 2 shuffled batches an epoch
        return epochs

    straight = fit("straight", 12)
    fit("first", 4)
    second = fit("second", 8, tmp_path / "first" / "epoch=1-step=4.ckpt")
    third = fit("third", 12, tmp_path / "second" / "epoch=3-step=8.ckpt")
    for step, run in [(8, "second"), (12, "third")]:
        expected, found = _load(tmp_path / "straight" / f"epoch={step // 2 - 1}-step={step}.ckpt"), None
        found = _load(tmp_path / run / f"epoch={step // 2 - 1}-step={step}.ckpt")
        assert found["loops"] == expected["loops"], run  # Lightning's epoch counters included
        _assert_same_training_state(expected, found)  # bit for bit
    # each epoch's start hook ran once, with the shuffle of its own epoch (the sampler's seed is the epoch count)
    assert second.seen == straight.seen[2:4] and third.seen == straight.seen[4:6]


# ---------------------------------------------------------------------------------------------- manual optimization


class ManualAdapterModel(AdapterModel):
    """``AdapterModel`` trained with manual optimization: the same AdamW steps, written out by hand."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_trains_as_automatic_optimization_does(tmp_path: Path) -> None:
    for name, cls in (("automatic", AdapterModel), ("manual", ManualAdapterModel)):
        trainer = cpu_trainer(max_steps=6)
        trainer.fit(cls(), regression_data())
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
    automatic, manual = _load(tmp_path / "automatic.ckpt"), _load(tmp_path / "manual.ckpt")
    assert manual["global_step"] == automatic["global_step"] == 6
    untrained = AdapterModel()
    assert not torch.equal(manual["state_dict"]["head.weight"], untrained.head.weight.detach())
    for name, value in automatic["state_dict"].items():
        torch.testing.assert_close(manual["state_dict"][name], value)


# ---------------------------------------------------------------------------------------------- tied weights


class TiedModel(L.LightningModule):
    """A tiny language model whose ``lm_head`` shares the embedding's weight, with a trainable adapter in between.

    ``train_tied`` makes the tied weight trainable too (it then appears once in ``named_parameters``).
    """

    frozen_base_reference = "tests/tied-model"

    def __init__(self, train_tied: bool = False, vocab: int = 11, width: int = 6, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.adapter = nn.Linear(width, width)
        self.embed.requires_grad_(train_tied)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.adapter(self.embed(tokens))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).float(), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _token_data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 11, (32,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, (tokens * 3 + 1) % 11), batch_size=8)


@pytest.mark.parametrize("train_tied", [False, True], ids=["tied-frozen", "tied-trainable"])
def test_tied_weights_save_resume_and_load(tmp_path: Path, train_tied: bool) -> None:
    def fit(max_epochs: int, name: str, resume: Path | None = None) -> dict[str, Any]:
        trainer = cpu_trainer(max_epochs=max_epochs)
        trainer.fit(TiedModel(train_tied), _token_data(), ckpt_path=resume)
        trainer.save_checkpoint(tmp_path / name)
        return _load(tmp_path / name)

    one = fit(1, "one.ckpt")
    straight, resumed = fit(2, "straight.ckpt"), fit(2, "resumed.ckpt", resume=tmp_path / "one.ckpt")
    trainable = ["adapter.bias", "adapter.weight"] + (["embed.weight"] if train_tied else [])
    assert sorted(straight["state_dict"]) == trainable
    assert sorted(straight["frozen_base"]["fingerprint"]["tensors"]) == ([] if train_tied else ["embed.weight"])
    _assert_same_training_state(straight, resumed)
    assert (one["global_step"], straight["global_step"]) == (4, 8)

    module = lightning_frozen.load_adapter(TiedModel(train_tied), tmp_path / "straight.ckpt")
    assert module.lm_head.weight is module.embed.weight
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(module.get_parameter(name), value)
    if not train_tied:
        with pytest.raises(lightning_frozen.FrozenBaseMismatchError, match="`embed.weight` holds different values"):
            lightning_frozen.load_adapter(TiedModel(seed=1), tmp_path / "straight.ckpt")


# ---------------------------------------------------------------------------------------------- two ranks, odd sizes


@pytest.mark.slow
def test_odd_sized_tensors_on_two_ranks_fingerprint_and_round_trip_exactly(tmp_path: Path) -> None:
    # width 7, rank 3: frozen 7x7 weights and 7-element biases, trainable 3x7 and 7x3 adapters, a 1x7 head; each is
    # split 4 + 3 (or 1 + 0) elements between the ranks, with ZeRO padding on the last
    odd = ("--width=7", "--rank=3", "--devices=2", "--max-epochs=1")
    # then, in the same world, resuming at the end of the saved epoch trains no further: what is saved again must be
    # what was loaded
    again = (f"--resume={tmp_path / 'one.ckpt'}", f"--save={tmp_path / 'again.ckpt'}", f"--report={tmp_path / 'again'}")
    one = (f"--save={tmp_path / 'one.ckpt'}", f"--report={tmp_path / 'one'}")
    run_script("train_adapter.py", *chained((*odd, *one), (*odd, *again)))
    saved, reloaded = _load(tmp_path / "one.ckpt"), _load(tmp_path / "again.ckpt")
    assert saved["state_dict"]["layers.0.lora_a"].shape == (3, 7)
    assert not torch.equal(saved["state_dict"]["layers.0.lora_b"], torch.zeros(7, 3))  # it trained
    _assert_same_training_state(saved, reloaded)
    frozen = [(n, p) for n, p in AdapterModel(width=7, rank=3).named_parameters() if not p.requires_grad]
    assert saved["frozen_base"]["fingerprint"]["digest"] == fingerprint_base(frozen)["digest"]
    # and the 2-rank checkpoint loads without DeepSpeed onto the unsharded module
    module = lightning_frozen.load_adapter(AdapterModel(width=7, rank=3), tmp_path / "one.ckpt")
    torch.testing.assert_close(module.layers[1].lora_b.detach(), saved["state_dict"]["layers.1.lora_b"])


# ------------------------------------------------------------------------------------- wholly frozen param groups


def _frozen_group_first(module: nn.Module) -> dict[str, Any]:
    """The frozen bases as group 0, the adapters and head as group 1, each with its own lambda."""
    frozen = [p for n, p in module.named_parameters() if ".base." in n]
    trained = [p for n, p in module.named_parameters() if ".base." not in n]
    optimizer = torch.optim.AdamW([{"params": frozen, "lr": 0.5}, {"params": trained, "lr": 0.01}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1.0, lambda s: 0.9**s])
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_a_wholly_frozen_group_is_saved_by_name_without_state_and_resumes_exactly(tmp_path: Path) -> None:
    def fit(epochs: int, resume: Path | None = None) -> dict[str, Any]:
        trainer = cpu_trainer(max_epochs=epochs)
        trainer.fit(AdapterModel(optimizer_fn=_frozen_group_first), regression_data(), ckpt_path=resume)
        trainer.save_checkpoint(tmp_path / f"{epochs}-{resume is not None}.ckpt")
        return _load(tmp_path / f"{epochs}-{resume is not None}.ckpt")

    one = fit(1)
    groups = one["optimizer_states"][0]["param_groups"]
    assert groups[0]["params"] == [
        "layers.0.base.weight",
        "layers.0.base.bias",
        "layers.1.base.weight",
        "layers.1.base.bias",
    ]
    assert not any(".base." in name for name in one["optimizer_states"][0]["state"])
    _assert_same_training_state(fit(2), fit(2, resume=tmp_path / "1-False.ckpt"))

    # a checkpoint of lightning-frozen 0.1 left the wholly frozen group out: refused, saying why
    old = dict(one, optimizer_states=[dict(one["optimizer_states"][0], param_groups=groups[1:])])
    torch.save(old, tmp_path / "old.ckpt")
    with pytest.raises(lightning_frozen.CheckpointFormatError, match=r"has 1 param groups.*has 2.*0\.1 left groups"):
        fit(2, resume=tmp_path / "old.ckpt")
