"""PEFT tuners besides plain LoRA under ``frozen_deepspeed``: prompt tuning, p-tuning, prefix tuning (with and
without its projection MLP), IA3, and LoRA with ``modules_to_save``.

Each is fit, saved, resumed, loaded with ``load_adapter`` and exported; ``PeftModel.from_pretrained`` on the export
gives the logits of the module loaded with ``load_adapter``, and the export holds what PEFT's own ``save_pretrained``
writes for that module. A tiny BERT (MiniLM's architecture, written with ``save_pretrained``) runs every tuner PEFT
supports on it; prefix tuning runs on a tiny Llama, since PEFT refuses it on BERT (shown below, without the strategy).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

import lightning_frozen
from lightning_frozen.base.fingerprint import fingerprint_base
from lightning_frozen.checkpoint.peft_export import peft_entry, prompt_embeddings
from lightning_frozen.errors import CheckpointFormatError
from tests.distributed import run_script
from tests.models import cpu_trainer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.peft_models import (  # noqa: E402
    TUNERS,
    PeftModule,
    base_model,
    batches,
    save_tiny_llama,
    tiny_bert_classifier,
)

PROMPT_LEARNING = {"prompt_tuning", "p_tuning", "prefix_tuning", "prefix_tuning_projection"}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module", params=list(TUNERS))
def trained(request: pytest.FixtureRequest, llama_folder: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two epochs of two steps with a checkpoint after each, and the second epoch again, resumed from the first."""
    tuner = request.param
    tmp = tmp_path_factory.mktemp(tuner)
    every_epoch = ModelCheckpoint(dirpath=tmp, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = cpu_trainer(max_epochs=2, callbacks=[every_epoch], enable_checkpointing=True)
    trainer.fit(PeftModule(tuner, llama_folder), batches(tuner))
    resumed = cpu_trainer(max_epochs=2)
    resumed.fit(PeftModule(tuner, llama_folder), batches(tuner), ckpt_path=tmp / "epoch=0.ckpt")
    resumed.save_checkpoint(tmp / "resumed.ckpt")
    return {
        "tuner": tuner,
        "llama": llama_folder,
        "tmp": tmp,
        "one": tmp / "epoch=0.ckpt",
        "two": tmp / "epoch=1.ckpt",
        "resumed": tmp / "resumed.ckpt",
    }


def _logits(model: Any, tuner: str) -> torch.Tensor:
    input_ids, attention_mask, _ = next(iter(batches(tuner)))
    with torch.no_grad():
        return model.eval()(input_ids=input_ids, attention_mask=attention_mask).logits


def test_checkpoint_holds_the_trainable_tensors_and_opens_weights_only(trained: dict) -> None:
    checkpoint = torch.load(trained["two"], weights_only=True)
    module = PeftModule(trained["tuner"], trained["llama"])
    trainable = sorted(name for name, param in module.named_parameters() if param.requires_grad)
    assert sorted(checkpoint["state_dict"]) == trainable
    entry = checkpoint["frozen_base"]["peft"]
    assert entry["config"]["peft_type"] == module.model.active_peft_config.peft_type.value
    json.dumps(entry["config"])  # plain JSON types only
    assert entry["not_in_adapter"] == [] and entry["not_exportable"] is None
    if trained["tuner"] in PROMPT_LEARNING:
        encoder = sorted(entry["prompt_encoder"].values())
        assert encoder == [name for name in trainable if name.startswith("model.prompt_encoder.default.")]
        assert encoder  # the prompt encoder's tensors are the adapter
    else:
        assert entry["prompt_encoder"] == {}
    if trained["tuner"] == "lora_modules_to_save":  # the classifier (SEQ_CLS) and the pooler (named) go in whole
        wrapped = {"base_model.model.classifier.weight", "base_model.model.bert.pooler.dense.weight"}
        assert wrapped <= set(entry["keys"].values())


def test_resume_continues_exactly(trained: dict) -> None:
    one, two, resumed = (torch.load(trained[key], weights_only=True) for key in ("one", "two", "resumed"))
    assert two["global_step"] == resumed["global_step"] == 4
    for name, value in two["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0)
    assert any(not torch.equal(one["state_dict"][name], value) for name, value in two["state_dict"].items())


def test_export_loads_in_peft_to_the_logits_of_load_adapter(trained: dict) -> None:
    tuner = trained["tuner"]
    checkpoint = torch.load(trained["two"], weights_only=True)
    ours = lightning_frozen.load_adapter(PeftModule(tuner, trained["llama"]), trained["two"])
    for name, value in checkpoint["state_dict"].items():
        torch.testing.assert_close(ours.get_parameter(name), value, rtol=0, atol=0)
    out = lightning_frozen.export_peft_adapter(trained["two"], trained["tmp"] / "export")
    theirs = peft.PeftModel.from_pretrained(base_model(tuner, trained["llama"]), str(out))

    expected = _logits(ours.model, tuner)
    torch.testing.assert_close(_logits(theirs, tuner), expected, rtol=1e-5, atol=1e-5)
    untrained = _logits(PeftModule(tuner, trained["llama"]).model, tuner)
    assert not torch.allclose(untrained, expected, atol=1e-4)  # training moved the logits: the match means something


def test_a_head_made_at_random_by_from_pretrained_does_not_fail_base_verification(trained: dict) -> None:
    # `from_pretrained(..., num_labels=2)` creates the classifier at random, so every load of the base differs there;
    # SEQ_CLS trains a copy of it (`modules_to_save`), and the adapted model never computes with the original
    tuner = trained["tuner"]
    if TUNERS[tuner][1]:
        pytest.skip("the causal Llama has no head made at random")
    recorded = torch.load(trained["two"], weights_only=True)["frozen_base"]["fingerprint"]["tensors"]
    assert not [name for name in recorded if ".original_module." in name]
    expected = _logits(lightning_frozen.load_adapter(PeftModule(tuner), trained["two"]).model, tuner)
    reloaded = PeftModule(tuner)
    originals = [p for name, p in reloaded.named_parameters() if ".original_module." in name]
    assert originals  # the classifier's original, at least
    with torch.no_grad():
        for param in originals:
            param.normal_()  # another random head, as a load without the tests' fixed seed gives
    lightning_frozen.load_adapter(reloaded, trained["two"])
    torch.testing.assert_close(_logits(reloaded.model, tuner), expected, rtol=0, atol=0)
    # 0.1.0 and `convert` recorded the originals too: they are left out when verifying
    legacy = torch.load(trained["two"], weights_only=True)
    every_frozen = sorted((n, p) for n, p in PeftModule(tuner).named_parameters() if not p.requires_grad)
    legacy["frozen_base"]["fingerprint"] = fingerprint_base(every_frozen)
    assert set(legacy["frozen_base"]["fingerprint"]["tensors"]) >= {n for n, _ in every_frozen if "original_mod" in n}
    torch.save(legacy, trained["tmp"] / "legacy.ckpt")
    lightning_frozen.load_adapter(reloaded, trained["tmp"] / "legacy.ckpt")
    embeddings = next(p for name, p in reloaded.named_parameters() if name.endswith("word_embeddings.weight"))
    with torch.no_grad():
        embeddings[0, 0] += 1  # a frozen weight the adapted model computes with is still verified
    with pytest.raises(lightning_frozen.FrozenBaseMismatchError, match="word_embeddings.weight` holds different"):
        lightning_frozen.load_adapter(reloaded, trained["two"])


def test_export_holds_what_peft_save_pretrained_writes(trained: dict) -> None:
    """For prompt learning PEFT saves the prompt encoder's output; export computes it from the saved weights."""
    tuner = trained["tuner"]
    ours = lightning_frozen.load_adapter(PeftModule(tuner, trained["llama"]), trained["two"])
    ours.model.save_pretrained(trained["tmp"] / "peft_own", save_embedding_layers=False)
    out = lightning_frozen.export_peft_adapter(trained["two"], trained["tmp"] / "export_compared")
    expected = load_file(trained["tmp"] / "peft_own" / "adapter_model.safetensors")
    exported = load_file(out / "adapter_model.safetensors")
    assert sorted(exported) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-6, atol=1e-6)
    if tuner in {"p_tuning", "prefix_tuning_projection"}:
        raw = ours.model.prompt_encoder["default"].embedding.weight.detach()
        assert exported["prompt_embeddings"].shape != raw.shape or not torch.allclose(
            exported["prompt_embeddings"], raw
        )


def test_prefix_tuning_on_bert_is_refused_by_peft_itself() -> None:
    """Why prefix tuning is tested on Llama: PEFT alone, without the strategy, cannot run it on BERT."""
    config = peft.PrefixTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4)
    model = peft.get_peft_model(tiny_bert_classifier(), config)
    input_ids = torch.tensor([[101, 2307, 102]])
    with pytest.raises(ValueError, match="does not support past key values"):
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))


def test_export_refuses_a_prompt_method_it_cannot_compute(tmp_path: Path) -> None:
    """Multitask prompt tuning saves a form export does not compute: saving works, export says so."""
    config = peft.MultitaskPromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4, num_tasks=2)
    model = peft.get_peft_model(tiny_bert_classifier(), config)
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    entry = peft_entry("", model, names)
    assert "MULTITASK_PROMPT_TUNING" in entry["not_exportable"]
    checkpoint = {
        "state_dict": {name: torch.zeros(1) for name in names},
        "frozen_base": {"reference": None, "fingerprint": {"mode": "none"}, "peft": entry},
        "lightning_frozen": {"format_version": 1},
    }
    torch.save(checkpoint, tmp_path / "multitask.ckpt")
    with pytest.raises(CheckpointFormatError, match=r"multitask\.ckpt cannot be exported.*MULTITASK_PROMPT_TUNING"):
        lightning_frozen.export_peft_adapter(tmp_path / "multitask.ckpt", tmp_path / "out")
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_two_ranks_save_a_prefix_encoder_that_exports_and_resumes_on_one(llama_folder: str, tmp_path: Path) -> None:
    """On 2 ranks each holds half of every prompt encoder tensor (some of odd size): the checkpoint gathers them whole,
    export computes the prefix from them, and one rank resumes from the file."""
    tuner = "prefix_tuning_projection"
    run_script("train_peft.py", f"--tuner={tuner}", f"--llama={llama_folder}", f"--save={tmp_path / 'two.ckpt'}")
    checkpoint = torch.load(tmp_path / "two.ckpt", weights_only=True)
    assert checkpoint["lightning_frozen"]["world_size"] == 2 and checkpoint["global_step"] == 2
    initial = PeftModule(tuner, llama_folder)
    for name, param in initial.named_parameters():
        if param.requires_grad:
            assert checkpoint["state_dict"][name].shape == param.shape, name
    assert checkpoint["state_dict"]["model.prompt_encoder.default.transform.0.bias"].numel() == 33

    ours = lightning_frozen.load_adapter(PeftModule(tuner, llama_folder), tmp_path / "two.ckpt")
    out = lightning_frozen.export_peft_adapter(tmp_path / "two.ckpt", tmp_path / "export")
    theirs = peft.PeftModel.from_pretrained(base_model(tuner, llama_folder), str(out))
    torch.testing.assert_close(_logits(theirs, tuner), _logits(ours.model, tuner), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(initial.model, tuner), _logits(ours.model, tuner), atol=1e-4)

    resumed = cpu_trainer(max_epochs=3)
    resumed.fit(PeftModule(tuner, llama_folder), batches(tuner), ckpt_path=tmp_path / "two.ckpt")
    assert resumed.global_step == 4


@pytest.mark.parametrize("encoder", ["MLP", "LSTM"])
def test_prompt_embeddings_are_what_peft_saves_for_a_p_tuning_encoder(encoder: str, llama_folder: str) -> None:
    """Export computes PEFT's saved tensor from the plain config and the encoder's weights, for both encoder types."""
    config = peft.PromptEncoderConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=9, encoder_reparameterization_type=encoder
    )
    model = peft.get_peft_model(base_model("prefix_tuning", llama_folder), config)
    entry = peft_entry("", model, [name for name, param in model.named_parameters() if param.requires_grad])
    params = dict(model.named_parameters())
    weights = {own: params[name].detach() for own, name in entry["prompt_encoder"].items()}
    assert any(own.startswith("lstm_head.") for own in weights) == (encoder == "LSTM")
    expected = model.get_prompt_embedding_to_save("default")
    torch.testing.assert_close(prompt_embeddings(entry["config"], weights), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(CheckpointFormatError, match=r"\['embedding.weight'.*do not fit the P_TUNING encoder"):
        prompt_embeddings(entry["config"], {**weights, "embedding.weight": torch.zeros(2, 64)})


def test_peft_loads_prompt_learning_adapters_for_inference_only(tmp_path: Path, llama_folder: str) -> None:
    """PEFT's own limit, without the strategy: to train a prompt on, resume from the lightning-frozen checkpoint."""
    config = peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=9)
    peft.get_peft_model(base_model("prefix_tuning", llama_folder), config).save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match="Cannot set a prompt learning adapter to trainable"):
        peft.PeftModel.from_pretrained(
            base_model("prefix_tuning", llama_folder), tmp_path / "adapter", is_trainable=True
        )


def test_a_prefix_encoder_built_in_configure_model_saves_and_exports(llama_folder: str, tmp_path: Path) -> None:
    """A base too large for one rank is built in ``configure_model`` (``from_pretrained`` into ZeRO-3 shards); the
    prompt encoder PEFT adds there is saved, loaded and exported like one built in ``__init__``."""
    tuner = "prefix_tuning_projection"
    module = PeftModule(tuner, llama_folder, in_configure_model=True)
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(module, batches(tuner))
    trainer.save_checkpoint(tmp_path / "adapter.ckpt")
    straight = PeftModule(tuner, llama_folder)  # built in `__init__`: the same base and adapter init
    cpu_trainer(max_epochs=1).fit(straight, batches(tuner))
    straight.trainer.save_checkpoint(tmp_path / "straight.ckpt")
    built_there = torch.load(tmp_path / "adapter.ckpt", weights_only=True)["state_dict"]
    built_straight = torch.load(tmp_path / "straight.ckpt", weights_only=True)["state_dict"]
    assert built_there.keys() == built_straight.keys() and built_there
    for name, value in built_straight.items():
        torch.testing.assert_close(built_there[name], value)

    ours = PeftModule(tuner, llama_folder, in_configure_model=True)
    ours.configure_model()
    lightning_frozen.load_adapter(ours, tmp_path / "adapter.ckpt")
    out = lightning_frozen.export_peft_adapter(tmp_path / "adapter.ckpt", tmp_path / "export")
    theirs = peft.PeftModel.from_pretrained(base_model(tuner, llama_folder), str(out))
    torch.testing.assert_close(_logits(theirs, tuner), _logits(ours.model, tuner), rtol=1e-5, atol=1e-5)


class VBLoRAModule(PeftModule):
    """VB-LoRA: PEFT's saving reads a vector bank shared by every layer under one alias the mapping cannot probe."""

    def _build(self) -> Any:
        config = peft.VBLoRAConfig(task_type="SEQ_CLS", target_modules=["query"], num_vectors=16, vector_length=128)
        return peft.get_peft_model(tiny_bert_classifier(), config)


def test_a_tuner_export_cannot_map_still_saves_resumes_and_loads(tmp_path: Path) -> None:
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(VBLoRAModule("ia3"), batches("ia3"))
    with pytest.warns(UserWarning, match="this VBLORA adapter cannot be exported to PEFT's format"):
        trainer.save_checkpoint(tmp_path / "vblora.ckpt")
    cpu_trainer(max_epochs=2).fit(VBLoRAModule("ia3"), batches("ia3"), ckpt_path=tmp_path / "vblora.ckpt")
    lightning_frozen.load_adapter(VBLoRAModule("ia3"), tmp_path / "vblora.ckpt")
    with pytest.raises(CheckpointFormatError, match=r"vblora\.ckpt cannot be exported.*VBLORA.*load_adapter"):
        lightning_frozen.export_peft_adapter(tmp_path / "vblora.ckpt", tmp_path / "out")
