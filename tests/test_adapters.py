"""Several LoRA adapters trained at once under ``frozen_deepspeed``: each ends exactly where it would alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
import peft
import pytest
import torch

import lightning_frozen
from lightning_frozen import adapters
from lightning_frozen.errors import AdapterSetupError
from lightning_frozen.hf import row_guard
from lightning_frozen.zero import adapter_clipping
from tests.adapter_models import FIT, SPECS, CausalAdapters, adapter_weights, peft_with_adapters, token_batches
from tests.distributed import run_script
from tests.models import cpu_trainer
from tests.peft_models import save_tiny_llama, tiny_llama

NAMES = ["x", "y", "z"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("llama")))


def fit_and_save(module: Any, path: Path, **kwargs: Any) -> dict[str, torch.Tensor]:
    trainer = cpu_trainer(**{**FIT, **kwargs})
    trainer.fit(module, token_batches())
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def alone(llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Each adapter trained in a run of its own, the plain PEFT way (DeepSpeed's own global-norm clipping)."""
    folder = tmp_path_factory.mktemp("alone")
    return {
        name: adapter_weights(fit_and_save(CausalAdapters(llama, [name], together=False), folder / name), name)
        for name in NAMES
    }


@pytest.fixture(scope="module")
def together(llama: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("together") / "sweep.ckpt"
    fit_and_save(CausalAdapters(llama, NAMES), path)
    return path


def test_each_adapter_trained_at_once_equals_its_run_alone(
    together: Path, alone: dict[str, dict[str, torch.Tensor]]
) -> None:
    state = torch.load(together, weights_only=True)["state_dict"]
    for name in NAMES:
        ours = adapter_weights(state, name)
        assert ours.keys() == alone[name].keys() and ours
        for key, value in ours.items():
            assert not torch.equal(value, torch.zeros_like(value)) or "lora_A" in key  # B has moved off its zero init
            torch.testing.assert_close(value, alone[name][key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_a_global_clipping_norm_would_couple_the_adapters(
    llama: str, tmp_path: Path, alone: dict[str, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter_clipping, "clip_per_adapter", lambda *args: None)
    state = fit_and_save(CausalAdapters(llama, NAMES), tmp_path / "global.ckpt")
    differ = [
        name
        for name in NAMES
        if not all(torch.allclose(v, alone[name][k], rtol=1e-5) for k, v in adapter_weights(state, name).items())
    ]
    assert differ == NAMES


class ClipsPerAdapter(CausalAdapters):
    """``x`` and ``y`` trained at once, each clipped by its own value given in its param group."""

    clips = {"x": 0.05, "y": 0.5}

    def configure_optimizers(self) -> Any:
        found = super().configure_optimizers()
        for group, name in zip(found["optimizer"].param_groups, self.hparams.names):
            group["gradient_clip_val"] = self.clips[name]
        return found


def test_each_adapter_is_clipped_by_its_own_value_from_its_param_group(
    llama: str, tmp_path: Path, alone: dict[str, dict[str, torch.Tensor]]
) -> None:
    # y alone with the Trainer's clip value set to y's own; x's run alone clips at FIT's 0.05
    y_alone = fit_and_save(CausalAdapters(llama, ["y"], together=False), tmp_path / "y.ckpt", gradient_clip_val=0.5)
    state = fit_and_save(ClipsPerAdapter(llama, ["x", "y"]), tmp_path / "clips.ckpt", gradient_clip_val=None)
    _same_adapters(state, alone["x"], ["x"])
    _same_adapters(state, y_alone, ["y"])
    assert not torch.allclose(adapter_weights(y_alone, "y")[next(iter(alone["y"]))], alone["y"][next(iter(alone["y"]))])
    saved = torch.load(tmp_path / "clips.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"]
    assert [group["gradient_clip_val"] for group in saved] == [0.05, 0.5]  # resumed with the run


class ClipsDisagree(ClipsPerAdapter):
    def configure_optimizers(self) -> Any:
        groups = adapters.adapter_param_groups(self, {"x": {"lr": 1e-2}, "y": {"lr": 1e-2}})
        x_params = groups[0]["params"]
        groups[0:1] = [
            {"params": x_params[:1], "gradient_clip_val": 0.1},
            {"params": x_params[1:], "gradient_clip_val": 0.2},
        ]
        return torch.optim.AdamW(groups)


class ClipsNotANumber(ClipsPerAdapter):
    clips = {"x": "high", "y": 0.5}


class ClipsOneAdapter(CausalAdapters):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(
            [{"params": [p for p in self.parameters() if p.requires_grad], "gradient_clip_val": 1}]
        )


@pytest.mark.parametrize(
    ("module", "names", "message"),
    [
        (ClipsDisagree, ["x", "y"], r"Adapter `x` has param groups with `gradient_clip_val` 0.1 and 0.2"),
        (ClipsOneAdapter, ["x"], r"`gradient_clip_val` in a param group.*Trainer\(gradient_clip_val="),
        (ClipsNotANumber, ["x", "y"], r"Adapter `x`'s `gradient_clip_val` is 'high'; give a number >= 0"),
    ],
)
def test_per_adapter_clip_values_that_cannot_apply_are_refused(
    llama: str, module: type, names: list[str], message: str
) -> None:
    with pytest.raises(AdapterSetupError, match=message):
        cpu_trainer(max_steps=1).fit(module(llama, names, together=len(names) > 1), token_batches())


def _logits(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch[0], attention_mask=batch[1]).logits


def test_one_adapter_exports_alone_and_peft_loads_it(llama: str, together: Path, tmp_path: Path) -> None:
    folder = lightning_frozen.export_peft_adapter(together, tmp_path / "y", adapter="y")
    exported = peft.PeftModel.from_pretrained(tiny_llama(llama), str(folder), adapter_name="y").eval()
    lone = lightning_frozen.load_adapter(CausalAdapters(llama, ["y"], together=False), together, adapter="y")
    state = torch.load(together, weights_only=True)["state_dict"]
    for name, param in lone.named_parameters():
        if name in state and ".y." in name:
            torch.testing.assert_close(param.detach(), state[name], rtol=0, atol=0)
    batch = next(iter(token_batches()))
    torch.testing.assert_close(_logits(exported, batch), _logits(lone.model, batch), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(exported, batch), _logits(tiny_llama(llama).eval(), batch), atol=1e-4)


def test_load_from_checkpoint_takes_one_adapter_of_the_run(llama: str, together: Path) -> None:
    module = lightning_frozen.load_from_checkpoint(CausalAdapters, together, adapter="z")
    assert module.model.active_adapters == ["z"]
    lone = lightning_frozen.load_adapter(CausalAdapters(llama, ["z"], together=False), together, adapter="z")
    batch = next(iter(token_batches()))
    torch.testing.assert_close(_logits(module.model, batch), _logits(lone.model.eval(), batch), rtol=1e-5, atol=1e-6)


def test_a_run_of_several_adapters_names_them_when_none_is_chosen(llama: str, together: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterSetupError, match=r"adapter `y` is not in `CausalAdapters`, which holds `x`"):
        lightning_frozen.load_adapter(CausalAdapters(llama, ["x"], together=False), together, adapter="y")
    with pytest.raises(ValueError, match=r"holds adapter\(s\) `x`, `y`, `z`. Pass `adapter=`"):
        lightning_frozen.export_peft_adapter(together, tmp_path / "out")
    with pytest.raises(ValueError, match=r"`x`, `y`, `z`, not `w`"):
        lightning_frozen.export_peft_adapter(together, tmp_path / "out", adapter="w")
    assert not (tmp_path / "out").exists()


def test_an_adapter_name_the_model_lacks_is_refused_naming_the_fix(llama: str) -> None:
    model = peft_with_adapters(llama, ["x", "y"])
    with pytest.raises(AdapterSetupError, match=r"Adapters `w` are named.*holds `x`, `y`.*add_adapter\(name, config\)"):
        adapters.train_adapters(model, ["x", "w"])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (lambda: peft.IA3Config(task_type="CAUSAL_LM", target_modules=["q_proj"], feedforward_modules=[]), "is IA3"),
        (lambda: peft.LoraConfig(target_modules=["q_proj"], use_dora=True), "uses DoRA"),
        (lambda: peft.LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]), "uses `modules_to_save`"),
    ],
)
def test_adapters_that_cannot_be_mixed_in_one_batch_are_refused(llama: str, config: Any, message: str) -> None:
    model = peft.get_peft_model(tiny_llama(llama), config(), adapter_name="x")
    model.add_adapter("y", config())
    with pytest.raises(AdapterSetupError, match=rf"{message}.*Train it in a run of its own"):
        adapters.train_adapters(model, ["x", "y"])


class OneGroup(CausalAdapters):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SharedHead(CausalAdapters):
    def _build(self) -> Any:
        model = super()._build()
        model.base_model.model.lm_head.requires_grad_(True)
        return model


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (OneGroup, r"Optimizer param group 0 holds params of adapters `x`, `y`.*adapter_param_groups"),
        (SharedHead, r"trainable params `model.base_model.model.lm_head.weight` belong to none of them"),
    ],
)
def test_optimizer_groups_or_params_shared_by_adapters_are_refused_at_setup(
    llama: str, module: type, message: str
) -> None:
    with pytest.raises(AdapterSetupError, match=message):
        cpu_trainer(max_steps=1).fit(module(llama, ["x", "y"]), token_batches())


def _same_adapters(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], names: list[str]) -> None:
    for name in names:
        mine = adapter_weights(ours, name)
        assert mine.keys() == adapter_weights(reference, name).keys() and mine
        for key, value in mine.items():
            torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_a_run_of_adapters_resumed_from_its_middle_ends_where_it_would_have(
    llama: str, together: Path, tmp_path: Path
) -> None:
    fit_and_save(CausalAdapters(llama, NAMES), tmp_path / "half.ckpt", max_epochs=1)
    trainer = cpu_trainer(**FIT)
    trainer.fit(CausalAdapters(llama, NAMES), token_batches(), ckpt_path=tmp_path / "half.ckpt")
    trainer.save_checkpoint(tmp_path / "resumed.ckpt")
    resumed = torch.load(tmp_path / "resumed.ckpt", weights_only=True)["state_dict"]
    _same_adapters(resumed, torch.load(together, weights_only=True)["state_dict"], NAMES)


@pytest.mark.slow
def test_two_ranks_train_each_adapter_as_alone_resume_exactly_and_resume_on_one(llama: str, tmp_path: Path) -> None:
    run_script("train_adapters_together.py", "--llama", llama, "--out", str(tmp_path), timeout=900)
    states = {path.stem: torch.load(path, weights_only=True)["state_dict"] for path in tmp_path.glob("*.ckpt")}
    for name in NAMES:
        _same_adapters(states["together"], states[f"alone_{name}"], [name])
    _same_adapters(states["resumed"], states["together"], NAMES)
    # the 2-rank run's middle resumes on 1 rank too (another data split, so not the same end)
    trainer = cpu_trainer(**FIT)
    trainer.fit(CausalAdapters(llama, NAMES), token_batches(), ckpt_path=tmp_path / "half.ckpt")
    assert trainer.global_step == 1 + 2  # one step in the 2-rank first epoch, then two of 2 batches on one rank
    assert [group["lr"] for group in trainer.optimizers[0].param_groups] == [SPECS[n]["lr"] for n in NAMES]


def test_adapters_trained_at_once_on_their_own_data_equal_their_runs_alone(
    llama: str, tmp_path: Path, alone: dict[str, dict[str, torch.Tensor]]
) -> None:
    tasks = {"x": token_batches(), "y": token_batches(seed=4)}  # x's data is what `alone` trained x on
    trainer = cpu_trainer(**FIT)
    # a dict of DataLoaders: Lightning combines them (`max_size_cycle`), and gives one batch per adapter at each step
    trainer.fit(CausalAdapters(llama, ["x", "y"]), tasks)
    trainer.save_checkpoint(tmp_path / "tasks.ckpt")
    state = torch.load(tmp_path / "tasks.ckpt", weights_only=True)["state_dict"]
    trainer = cpu_trainer(**FIT)
    trainer.fit(CausalAdapters(llama, ["y"], together=False), tasks["y"])
    trainer.save_checkpoint(tmp_path / "y.ckpt")
    _same_adapters(state, alone["x"], ["x"])
    _same_adapters(state, torch.load(tmp_path / "y.ckpt", weights_only=True)["state_dict"], ["y"])


def test_with_gradient_checkpointing_each_adapter_still_trains_exactly_as_alone(
    llama: str, alone: dict[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    # backward recomputes each decoder layer after `adapter_rows` has ended: the rows travel with the checkpointed
    # forward. Were they lost, the row guard would refuse the recomputed forward (every row through x and y) or, past
    # it, each adapter would get the other's rows' gradients.
    module = CausalAdapters(llama, ["x", "y"], checkpointing=True)
    recomputed = {"layers": 0}
    model = module.model.base_model.model
    layer = model.model.layers[0]
    checkpoint = layer._gradient_checkpointing_func

    def counting(function: Any, *args: Any, **kwargs: Any) -> Any:
        def counted(*inner: Any, **inner_kwargs: Any) -> Any:
            recomputed["layers"] += not row_guard._ROWS_GIVEN  # outside every rows context: a recomputation
            return function(*inner, **inner_kwargs)

        return checkpoint(counted, *args, **kwargs)

    layer._gradient_checkpointing_func = counting
    state = fit_and_save(module, tmp_path / "checkpointed.ckpt")
    assert model.is_gradient_checkpointing and recomputed["layers"] > 0  # it ran outside the context, in backward
    assert layer._gradient_checkpointing_func is counting  # restored after each step
    for name in ["x", "y"]:
        ours = adapter_weights(state, name)
        assert ours.keys() == alone[name].keys() and ours
        for key, value in ours.items():
            torch.testing.assert_close(value, alone[name][key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_a_forward_another_library_set_on_a_lora_layer_is_put_back_after_the_rows(llama: str) -> None:
    model = peft_with_adapters(llama, ["x", "y"])
    adapters.train_adapters(model, ["x", "y"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    hooked = layer.forward  # a bound method set on the instance, as accelerate's hooks do
    layer.forward = hooked
    (input_ids, attention_mask), rows = adapters.sweep_batch(next(iter(token_batches())), ["x", "y"])
    with adapters.adapter_rows(model, rows):
        assert layer.forward is not hooked  # inside, the layer computes each block of rows with its adapter
        model(input_ids=input_ids, attention_mask=attention_mask)
    assert layer.__dict__["forward"] is hooked


def test_rows_refuse_checkpointing_they_cannot_reach_and_layers_that_reshape_the_batch(llama: str) -> None:
    model = peft_with_adapters(llama, ["x", "y"])
    adapters.train_adapters(model, ["x", "y"])
    (input_ids, attention_mask), rows = adapters.sweep_batch(next(iter(token_batches())), ["x", "y"])
    with pytest.raises(AdapterSetupError, match="got 4 rows where the batch has 8"), adapters.adapter_rows(model, rows):
        model(input_ids=input_ids[:4], attention_mask=attention_mask[:4])
    model.base_model.model.model.gradient_checkpointing = True  # a module's own checkpointing, no function to wrap
    with pytest.raises(AdapterSetupError, match="gradient_checkpointing_disable"), adapters.adapter_rows(model, rows):
        pass


class ForgetsRows(CausalAdapters):
    """Two adapters trained, the batch passed through the model as it is: every row through every adapter."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, attention_mask = batch
        return self._token_losses(input_ids, attention_mask).mean()


class SharesRowsOnPurpose(ForgetsRows):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with adapters.shared_rows(self.model):  # both adapters on every row, as PEFT computes them, on purpose
            return super().training_step(batch, batch_idx)


def test_a_training_forward_of_several_adapters_outside_adapter_rows_is_refused_with_the_fix(llama: str) -> None:
    message = r"`x`, `y` to every row, outside `lightning_frozen.adapters.adapter_rows`"
    with pytest.raises(AdapterSetupError, match=message) as caught:
        cpu_trainer(max_steps=1).fit(ForgetsRows(llama, ["x", "y"]), token_batches())
    assert "shared_rows" in str(caught.value)


def test_adapters_trained_on_the_same_rows_on_purpose_say_so_with_shared_rows(llama: str) -> None:
    module = SharesRowsOnPurpose(llama, ["x", "y"])
    trainer = cpu_trainer(max_steps=2)
    trainer.fit(module, token_batches())
    assert trainer.global_step == 2
    hooks = [hook for layer in module.modules() for hook in layer._forward_pre_hooks.values()]
    assert not [hook for hook in hooks if getattr(hook, "func", None) is row_guard._refuse]  # removed at teardown
    # after the run the module is the user's: a forward of its shards gathered is refused by nothing
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(module.parameters())):
        module.model(input_ids=next(iter(token_batches()))[0])
    one = cpu_trainer(max_steps=1)
    one.fit(ForgetsRows(llama, ["x"], together=False), token_batches())  # one adapter: nothing to couple
    assert one.global_step == 1


def test_lora_dropout_is_allowed_with_a_warning_that_runs_are_not_identical(llama: str) -> None:
    model = peft.get_peft_model(tiny_llama(llama), peft.LoraConfig(target_modules=["q_proj"], lora_dropout=0.1))
    model.add_adapter("y", peft.LoraConfig(target_modules=["q_proj"]))
    with pytest.warns(UserWarning, match="set `lora_dropout=0`"):
        adapters.train_adapters(model, ["default", "y"])
    assert adapters.trained_adapters(model) == ["default", "y"]
