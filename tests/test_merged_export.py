"""``export_merged``: the adapter folded into its base, written as a Hugging Face folder one tensor at a time.

Each case compares the folder with PEFT's own way on the same checkpoint: ``export_peft_adapter``, then
``PeftModel.from_pretrained(base, ...).merge_and_unload()`` and ``save_pretrained``: the same tensor names, the same
logits. Checkpoints are written by the package's own builder (``saved_checkpoint``, what a save writes) from PEFT
models whose adapters were moved off their initial values, so that no fit is needed; the nf4 case trains for real.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from safetensors import safe_open

import lightning_frozen
from lightning_frozen import anatomy, progress
from lightning_frozen.base.fingerprint import fingerprint_base, named_frozen
from lightning_frozen.checkpoint.trainable_state import saved_checkpoint
from lightning_frozen.cli import main
from lightning_frozen.errors import FrozenBaseMismatchError, UnsupportedConfigurationError
from lightning_frozen.zero.params import persistent_buffers

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from examples.causal_lm_lora.make_base import write_random_llama  # noqa: E402
from tests import peft_models  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.peft_models import tiny_bert_folder  # noqa: E402
from tests.pretrained_support import EXPERTS, MOE_CONFIGS, MoELoRA, PretrainedLoRA, moe_folder, token_data  # noqa: E402

TINY_LLAMA = {**peft_models.TINY_LLAMA, "max_position_embeddings": 64}
TOKENS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
QV = ["q_proj", "v_proj"]

# every tuner PEFT merges, on the tiny Llama (BOFT merges as well, but its probe for a CUDA extension leaves the
# process's DeepSpeed fits 15x slower: it is left out of the suite)
TUNERS: dict[str, Callable[[], Any]] = {
    "lora": lambda: peft.LoraConfig(r=4, target_modules=QV, task_type="CAUSAL_LM"),
    "rslora": lambda: peft.LoraConfig(r=4, lora_alpha=16, target_modules=QV, use_rslora=True),
    "dora": lambda: peft.LoraConfig(r=4, target_modules=[*QV, "down_proj"], use_dora=True),
    "ia3": lambda: peft.IA3Config(target_modules=[*QV, "down_proj"], feedforward_modules=["down_proj"]),
    "loha": lambda: peft.LoHaConfig(r=4, target_modules=QV),
    "lokr": lambda: peft.LoKrConfig(r=4, target_modules=QV),
    "oft": lambda: peft.OFTConfig(r=8, oft_block_size=0, target_modules=QV),
    "fourierft": lambda: peft.FourierFTConfig(n_frequency=20, target_modules=QV),
    "hra": lambda: peft.HRAConfig(r=4, target_modules=QV),
    "miss": lambda: peft.MissConfig(r=4, target_modules=QV),
    "c3a": lambda: peft.C3AConfig(block_size=16, target_modules=QV),
    "gralora": lambda: peft.GraloraConfig(r=4, gralora_k=2, target_modules=QV),
    "ln_tuning": lambda: peft.LNTuningConfig(target_modules=["input_layernorm"]),
    "delora": lambda: peft.DeloraConfig(r=4, target_modules=QV),
    "randlora": lambda: peft.RandLoraConfig(r=4, target_modules=QV),
    "road": lambda: peft.RoadConfig(group_size=4, target_modules=QV),
    "trainable_tokens": lambda: peft.TrainableTokensConfig(
        target_modules=["embed_tokens"], token_indices=[47, 172, 211]
    ),
}


def llama_folder(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0, **config: Any) -> Path:
    write_random_llama(folder, {**TINY_LLAMA, **config}, dtype, seed)
    return folder


class Adapted(torch.nn.Module):
    """What a LightningModule holds: a PEFT model over a base loaded from a folder, under ``model``."""

    def __init__(self, base: torch.nn.Module, config: Any, more: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.model = peft.get_peft_model(base, config)
        for name, extra in (more or {}).items():
            self.model.add_adapter(name, extra)
        for name, param in self.model.named_parameters():
            if any(f".{adapter}." in name for adapter in [*(more or {}), "default"]) and "base_layer" not in name:
                param.requires_grad_(True)
        noise = torch.Generator().manual_seed(5)
        with torch.no_grad():  # moved off PEFT's initial values (LoRA's B is 0): the merge changes the weights
            for param in self.model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn(param.shape, generator=noise).to(param.dtype) * 0.1)


def write_checkpoint(module: torch.nn.Module, path: Path) -> Path:
    """The file a save of ``module`` writes: its trainable tensors (fp32), the fingerprint, the PEFT entries."""
    found = anatomy.anatomy_of(module)
    state = {name: p.detach().float().clone() for name, p in module.named_parameters() if p.requires_grad}
    state |= {name: buffer.clone() for name, buffer in persistent_buffers(module).items()}
    fingerprint = fingerprint_base(named_frozen(module, copies=found.trained_copies))
    torch.save(saved_checkpoint({"state_dict": state}, module, found, fingerprint, world_size=1), path)
    return path


def peft_merged(auto_class: Any, base: Path, checkpoint: Path, tmp: Path, adapter: Optional[str] = None, **kw: Any):
    """PEFT's own way from the same checkpoint: the exported adapter loaded over the base, merged, saved."""
    exported = lightning_frozen.export_peft_adapter(checkpoint, tmp / "peft_adapter", adapter=adapter)
    loaded = auto_class.from_pretrained(str(base), **kw)
    merged = peft.PeftModel.from_pretrained(loaded, str(exported)).merge_and_unload()
    merged.save_pretrained(tmp / "peft_merged")
    return merged.eval()


def saved_keys(folder: Path) -> dict[str, torch.dtype]:
    keys = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as opened:
            keys.update({key: opened.get_slice(key).get_dtype() for key in sorted(opened.keys())})
    return keys


def logits(model: Any, **inputs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**inputs).logits.float()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_folder(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("tuner", list(TUNERS))
def test_each_tuner_merges_as_peft_merge_and_unload(tuner: str, llama: Path, tmp_path: Path) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    checkpoint = write_checkpoint(Adapted(base, TUNERS[tuner]()), tmp_path / "run.ckpt")
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    theirs = peft_merged(transformers.AutoModelForCausalLM, llama, checkpoint, tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert saved_keys(out) == saved_keys(tmp_path / "peft_merged")
    expected = logits(theirs, input_ids=TOKENS)
    torch.testing.assert_close(logits(ours, input_ids=TOKENS), expected, rtol=1e-5, atol=1e-5)
    unmerged = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    assert not torch.allclose(logits(unmerged, input_ids=TOKENS), expected, atol=1e-4)  # the merge changed the model


def test_a_bf16_base_merges_in_bf16_and_dtype_chooses_another(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / "bf16", torch.bfloat16)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    checkpoint = write_checkpoint(Adapted(base, TUNERS["lora"]()), tmp_path / "run.ckpt")
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    assert set(saved_keys(out).values()) == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    theirs = peft_merged(transformers.AutoModelForCausalLM, folder, checkpoint, tmp_path, dtype=torch.bfloat16)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    for name, value in theirs.state_dict().items():  # PEFT's merge, in bf16, bit for bit
        assert torch.equal(ours.state_dict()[name], value), name
    torch.testing.assert_close(logits(ours, input_ids=TOKENS), logits(theirs, input_ids=TOKENS), rtol=0, atol=0)

    wide = lightning_frozen.export_merged(checkpoint, tmp_path / "fp32", dtype="float32")
    assert set(saved_keys(wide).values()) == {"F32"}
    assert json.loads((wide / "config.json").read_text())["dtype"] == "float32"


def test_mt5_seq2seq(tmp_path: Path) -> None:
    config = transformers.MT5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4
    )
    torch.manual_seed(0)
    transformers.MT5ForConditionalGeneration(config).save_pretrained(tmp_path / "mt5")
    folder = tmp_path / "mt5"
    (
        folder / "generation_config.json"
    ).unlink()  # a base folder without one: the export writes what save_pretrained does
    base = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(folder))
    lora = peft.LoraConfig(r=4, target_modules=["q", "v"], task_type="SEQ_2_SEQ_LM")
    checkpoint = write_checkpoint(Adapted(base, lora), tmp_path / "run.ckpt")
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    theirs = peft_merged(transformers.AutoModelForSeq2SeqLM, folder, checkpoint, tmp_path)
    ours = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out))
    assert saved_keys(out) == saved_keys(tmp_path / "peft_merged")
    generation = json.loads((out / "generation_config.json").read_text())  # the folder had none: as save_pretrained
    theirs_generation = json.loads((tmp_path / "peft_merged" / "generation_config.json").read_text())
    tokens = ("decoder_start_token_id", "eos_token_id", "pad_token_id")
    assert {key: generation[key] for key in tokens} == {key: theirs_generation[key] for key in tokens}
    inputs = dict(input_ids=TOKENS % 128, decoder_input_ids=TOKENS[:, :4] % 128)
    torch.testing.assert_close(logits(ours, **inputs), logits(theirs, **inputs), rtol=1e-5, atol=1e-5)


def test_bert_classifier_with_modules_to_save_and_its_tokenizer(tmp_path: Path) -> None:
    from examples.minilm_lora.task import minilm_folder

    folder = tmp_path / "bert"
    transformers.BertModel.from_pretrained(str(tiny_bert_folder())).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(minilm_folder())).save_pretrained(folder)
    torch.manual_seed(0)
    base = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=2)
    lora = peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS", modules_to_save=["pooler"])
    checkpoint = write_checkpoint(Adapted(base, lora), tmp_path / "run.ckpt")
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    theirs = peft_merged(transformers.AutoModelForSequenceClassification, folder, checkpoint, tmp_path)
    ours = transformers.AutoModelForSequenceClassification.from_pretrained(str(out))
    assert saved_keys(out) == saved_keys(tmp_path / "peft_merged")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))  # copied from the base folder
    assert not (out / "generation_config.json").exists()  # an encoder generates nothing
    inputs = dict(tokenizer(["a wonderful film", "dull"], padding=True, return_tensors="pt"))
    torch.testing.assert_close(logits(ours, **inputs), logits(theirs, **inputs), rtol=1e-5, atol=1e-5)
    trained_head = torch.load(checkpoint, weights_only=True)["state_dict"]
    copy = next(
        value for name, value in trained_head.items() if name.endswith("classifier.modules_to_save.default.weight")
    )
    torch.testing.assert_close(ours.classifier.weight, copy)  # the trained copy replaced its original


def test_the_class_recorded_at_save_is_built_and_an_older_file_is_guessed(tmp_path: Path) -> None:
    folder = tmp_path / "bert"  # its config.json names BertModel, the class the module did not build
    transformers.BertModel.from_pretrained(str(tiny_bert_folder())).save_pretrained(folder)
    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification.from_pretrained(str(folder), num_labels=2)
    lora = peft.LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"])  # no task type
    checkpoint = write_checkpoint(Adapted(base, lora), tmp_path / "run.ckpt")
    saved = torch.load(checkpoint, weights_only=True)
    recorded = saved["frozen_base"]["peft"]["adapted_class"]
    assert recorded == "transformers.models.bert.modeling_bert.BertForSequenceClassification"
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
    theirs = peft_merged(transformers.BertForSequenceClassification, folder, checkpoint, tmp_path)
    ours = transformers.BertForSequenceClassification.from_pretrained(str(out))
    inputs = dict(input_ids=TOKENS % 100)
    torch.testing.assert_close(logits(ours, **inputs), logits(theirs, **inputs), rtol=1e-5, atol=1e-5)

    del saved["frozen_base"]["peft"]["adapted_class"]  # a file written before the class was recorded: guessed
    torch.save(saved, tmp_path / "older.ckpt")
    with pytest.raises(lightning_frozen.CheckpointFormatError, match="no model class of .* holds the tensors"):
        lightning_frozen.export_merged(tmp_path / "older.ckpt", tmp_path / "guessed")  # BertModel, AutoModel: not it
    llama = llama_folder(tmp_path / "llama")
    module = Adapted(transformers.AutoModelForCausalLM.from_pretrained(str(llama)), peft.LoraConfig(target_modules=QV))
    older = torch.load(write_checkpoint(module, tmp_path / "llama.ckpt"), weights_only=True)
    del older["frozen_base"]["peft"]["adapted_class"]
    torch.save(older, tmp_path / "llama-older.ckpt")
    out = lightning_frozen.export_merged(tmp_path / "llama-older.ckpt", tmp_path / "llama-merged")  # config's class
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_tied_embeddings_stay_tied_unless_the_adapter_changed_one_side(tmp_path: Path, caplog: Any) -> None:
    folder = llama_folder(tmp_path / "tied", tie_word_embeddings=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    checkpoint = write_checkpoint(Adapted(base, TUNERS["lora"]()), tmp_path / "qv.ckpt")
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "qv")
    assert "lm_head.weight" not in saved_keys(out)  # written once, as save_pretrained writes it
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight

    module = Adapted(
        transformers.AutoModelForCausalLM.from_pretrained(str(folder)),
        peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
    )
    checkpoint = write_checkpoint(module, tmp_path / "head.ckpt")
    with pytest.warns(UserWarning, match=r"changed .*lm_head\.weight.*untied .*tie_word_embeddings: false"):
        out = lightning_frozen.export_merged(checkpoint, tmp_path / "head")
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(saved_keys(out))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    # the model the run trained: the embedding as it was, the head with its LoRA (PEFT's merge would change both)
    expected = logits(module.model, input_ids=TOKENS)
    torch.testing.assert_close(logits(ours, input_ids=TOKENS), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.model.embed_tokens.weight, base.model.embed_tokens.weight, rtol=0, atol=0)


def test_a_sharded_folder_has_a_valid_index_and_progress_is_shown(
    llama: Path, tmp_path: Path, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    checkpoint = write_checkpoint(Adapted(base, TUNERS["lora"]()), tmp_path / "run.ckpt")
    monkeypatch.setattr(progress, "INTERVAL_SECONDS", -1.0)  # a line after every tensor
    with caplog.at_level(logging.INFO):
        out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged", max_shard_size="40KB")
    assert re.search(
        r"writing the merged model: 1 tensors, 0\.\d of 0\.\d MiB \(\d+%\) in .* MiB/s, about", caplog.text
    )
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    assert all(path.stat().st_size <= 40_000 + 4096 or _tensors_in(path) == 1 for path in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    in_files = {key: shard.name for shard in shards for key in sorted(safe_open(str(shard), "pt").keys())}
    assert index["weight_map"] == in_files
    sizes = {
        key: opened.get_tensor(key).nbytes
        for shard in shards
        for opened in [safe_open(str(shard), "pt")]
        for key in sorted(opened.keys())
    }
    assert index["metadata"]["total_size"] == sum(sizes.values())
    theirs = peft_merged(transformers.AutoModelForCausalLM, llama, checkpoint, tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(logits(ours, input_ids=TOKENS), logits(theirs, input_ids=TOKENS), rtol=1e-5, atol=1e-5)


def _tensors_in(path: Path) -> int:
    return len(safe_open(str(path), "pt").keys())


def test_one_adapter_of_a_run_of_several_alone(llama: Path, tmp_path: Path) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    more = {"y": peft.LoraConfig(r=2, target_modules=["v_proj", "o_proj"])}
    checkpoint = write_checkpoint(Adapted(base, peft.LoraConfig(r=4, target_modules=QV), more), tmp_path / "run.ckpt")
    assert set(torch.load(checkpoint, weights_only=True)["frozen_base"]["peft_adapters"]) == {"default", "y"}
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged", adapter="y")
    theirs = peft_merged(transformers.AutoModelForCausalLM, llama, checkpoint, tmp_path, adapter="y")
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(logits(ours, input_ids=TOKENS), logits(theirs, input_ids=TOKENS), rtol=1e-5, atol=1e-5)
    # q_proj is adapted by `default` only: merging `y` alone leaves it as it was
    torch.testing.assert_close(
        ours.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.base_layer.weight
    )
    with pytest.raises(ValueError, match=r"holds adapter\(s\) `default`, `y`, not `z`"):
        lightning_frozen.export_merged(checkpoint, tmp_path / "z", adapter="z")
    assert not (tmp_path / "z").exists()


def test_a_base_trained_under_nf4_merges_into_the_folders_weights(tmp_path: Path, caplog: Any) -> None:
    folder = llama_folder(tmp_path / "base")
    trainer = cpu_trainer(
        lightning_frozen.FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4"), max_steps=2, precision="32-true"
    )
    trainer.fit(PretrainedLoRA(str(folder), lr=5e-2), token_data())
    trainer.save_checkpoint(tmp_path / "nf4.ckpt")
    with caplog.at_level(logging.INFO):
        out = lightning_frozen.export_merged(tmp_path / "nf4.ckpt", tmp_path / "merged")
    assert "trained on a base stored as nf4; the adapter is merged into the original weights" in caplog.text
    theirs = peft_merged(transformers.AutoModelForCausalLM, folder, tmp_path / "nf4.ckpt", tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(logits(ours, input_ids=TOKENS), logits(theirs, input_ids=TOKENS), rtol=1e-5, atol=1e-5)


def test_a_changed_base_folder_is_refused_and_nothing_is_left(llama: Path, tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    checkpoint = write_checkpoint(Adapted(base, TUNERS["lora"]()), tmp_path / "run.ckpt")
    earlier = lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    before = {path.name: path.read_bytes() for path in earlier.iterdir()}
    changed = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        changed.model.layers[1].mlp.up_proj.weight[0, 0] += 1
    changed.save_pretrained(folder)
    with pytest.raises(
        FrozenBaseMismatchError, match=r"layers\.1\.mlp\.up_proj\.weight` holds different values.*export_peft_adapter"
    ):
        lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    # refused after every shard was written, before the rename: the earlier export is whole, no temp folder is left
    assert {path.name: path.read_bytes() for path in earlier.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["base", "merged", "run.ckpt"]


@pytest.mark.parametrize(
    "config, lacking",
    [
        (lambda: peft.AdaLoraConfig(r=4, target_modules=QV, total_step=10), "needs `.*ranknum.default`"),
        (lambda: peft.ShiraConfig(r=4, target_modules=QV), "cannot create this adapter's layers without their base"),
    ],
)
def test_a_tuner_needing_state_peft_computes_from_the_base_is_refused(
    config: Callable[[], Any], lacking: str, llama: Path, tmp_path: Path
) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    checkpoint = write_checkpoint(Adapted(base, config()), tmp_path / "run.ckpt")
    with pytest.raises(UnsupportedConfigurationError, match=f"{lacking}.*export_peft_adapter"):
        lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    assert sorted(os.listdir(tmp_path)) == ["run.ckpt"]


def test_prompt_tuning_is_refused_pointing_to_the_adapter_export(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    checkpoint = write_checkpoint(Adapted(base, config), tmp_path / "run.ckpt")
    with pytest.raises(
        UnsupportedConfigurationError, match=r"PROMPT_TUNING adapter cannot be merged.*export_peft_adapter"
    ):
        lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_a_moved_base_is_named_and_taken_from_base(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    checkpoint = write_checkpoint(Adapted(base, TUNERS["lora"]()), tmp_path / "run.ckpt")
    folder.rename(tmp_path / "moved")
    with pytest.raises(
        lightning_frozen.BaseFolderError,
        match=r"trained on the frozen base .*base'?, which is no folder.*base='path/to/base'\)`,"
        " or `--base path/to/base` to `lightning-frozen export-merged`",
    ):
        lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged", base=tmp_path / "moved")
    theirs = peft_merged(transformers.AutoModelForCausalLM, tmp_path / "moved", checkpoint, tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(logits(ours, input_ids=TOKENS), logits(theirs, input_ids=TOKENS), rtol=1e-5, atol=1e-5)
    with pytest.raises(FrozenBaseMismatchError, match="holds different values"):  # another base is verified as well
        lightning_frozen.export_merged(
            checkpoint, tmp_path / "other", base=llama_folder(tmp_path / "other_base", seed=1)
        )


def test_the_cli_step_writes_the_same_folder(llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    checkpoint = write_checkpoint(Adapted(base, TUNERS["lora"]()), tmp_path / "run.ckpt")
    main(["export-merged", str(checkpoint), str(tmp_path / "cli"), "--dtype", "bfloat16", "--max-shard-size", "200KB"])
    assert f"lightning-frozen export-merged: wrote {tmp_path / 'cli'}" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model.safetensors.index.json").exists()  # the small shard size was passed on
    python = lightning_frozen.export_merged(checkpoint, tmp_path / "python", dtype="bfloat16", max_shard_size="200KB")
    assert saved_keys(tmp_path / "cli") == saved_keys(python)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "cli"), dtype=torch.bfloat16)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(python), dtype=torch.bfloat16)
    for name, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name


def folder_values(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {key: value for shard in sorted(folder.glob("*.safetensors")) for key, value in load_file(shard).items()}


@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_a_moe_base_trained_on_attention_and_experts_merges_as_peft_does_with_save_pretrained_keys(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = moe_folder(tmp_path / "base", kind)
    trainer = cpu_trainer(max_steps=3, precision="32-true")
    trainer.fit(MoELoRA(str(folder), lr=5e-2), token_data())
    trainer.save_checkpoint(tmp_path / "moe.ckpt")
    if kind == "mixtral":
        out = lightning_frozen.export_merged(tmp_path / "moe.ckpt", tmp_path / "merged")
    else:  # the CLI step: the same function
        main(["export-merged", str(tmp_path / "moe.ckpt"), str(tmp_path / "merged")])
        assert f"wrote {tmp_path / 'merged'}" in capsys.readouterr().out
        out = tmp_path / "merged"
    assert_moe_merged_as_peft(folder, tmp_path / "moe.ckpt", out, tmp_path)


def assert_moe_merged_as_peft(folder: Path, checkpoint: Path, out: Path, tmp: Path) -> Any:
    """``out``, the merged export of ``checkpoint`` (trained on the MoE ``folder``), against PEFT's merge: the keys
    ``save_pretrained`` writes (one tensor per expert), each tensor, the logits (fp32, 1e-4). Returns the model
    ``out`` loads as."""
    theirs = peft_merged(transformers.AutoModelForCausalLM, folder, checkpoint, tmp)
    assert saved_keys(out) == saved_keys(tmp / "peft_merged")  # save_pretrained's keys: one tensor per expert
    base, ours, peft_written = folder_values(folder), folder_values(out), folder_values(tmp / "peft_merged")
    experts = [key for key in base if key.startswith("model.layers.1.") and ".experts.3." in key]
    assert len(experts) == 3 and set(experts) <= set(ours)
    for key in experts:  # LoRA on the fused experts, split back per expert as the folder stores them
        assert not torch.equal(ours[key], base[key]), key
    for key, value in peft_written.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(merged).__name__ == type(theirs).__name__
    torch.testing.assert_close(logits(merged, input_ids=TOKENS), logits(theirs, input_ids=TOKENS), rtol=0, atol=1e-4)
    return merged


def test_a_conversion_transformers_cannot_revert_is_refused_naming_the_model_type(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import conversion_mapping
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class OneWay(ConversionOps):  # a conversion with no reverse op
        def convert(self, input_dict: dict, source_patterns: list, target_patterns: list, **kwargs: Any) -> dict:
            return {target_patterns[0]: next(iter(input_dict.values()))[0]}

    base = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    checkpoint = write_checkpoint(Adapted(base, TUNERS["lora"]()), tmp_path / "run.ckpt")
    conversion_mapping.get_checkpoint_conversion_mapping("llama")  # the table built, then one entry added for the test
    one_way = WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", operations=[OneWay()])
    monkeypatch.setitem(conversion_mapping._checkpoint_conversion_mapping_cache, "LlamaForCausalLM", [one_way])
    with pytest.raises(
        UnsupportedConfigurationError,
        match=r"converts the tensors of this 'llama' base as it loads them, and cannot revert it .*merge_and_unload",
    ):
        lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run.ckpt"]  # nor a temporary folder beside it


def test_a_revert_that_transposes_square_experts_is_followed_where_the_forward_converter_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Square experts (intermediate size = hidden size) and a reverse op that transposes them: the folder's names and
    shapes come back, their values do not sit where the forward converter put them; the export writes each expert as
    transformers' own revert (``save_pretrained``) writes it."""
    from transformers.core_model_loading import SplitModulelist

    config = transformers.AutoConfig.for_model(
        "mixtral", **{**TINY_LLAMA, "intermediate_size": TINY_LLAMA["hidden_size"]}, **MOE_CONFIGS["mixtral"]
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "base"))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    lora = peft.LoraConfig(r=4, target_modules=QV, target_parameters=EXPERTS)
    checkpoint = write_checkpoint(Adapted(base, lora), tmp_path / "run.ckpt")
    split = SplitModulelist.convert

    def split_transposing_squares(self: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        parts = split(self, *args, **kwargs).items()
        return {key: part.mT if part.ndim == 2 and part.shape[0] == part.shape[1] else part for key, part in parts}

    monkeypatch.setattr(SplitModulelist, "convert", split_transposing_squares)
    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    peft_merged(transformers.AutoModelForCausalLM, tmp_path / "base", checkpoint, tmp_path)  # saved by the same revert
    ours, theirs, folder = folder_values(out), folder_values(tmp_path / "peft_merged"), folder_values(tmp_path / "base")
    experts = [key for key in theirs if ".experts." in key]
    assert len(experts) == 2 * 4 * 3 and saved_keys(out) == saved_keys(tmp_path / "peft_merged")
    for key in experts:  # each transposed against the folder's layout, as the revert writes it
        assert (theirs[key] - folder[key].mT).norm() < (theirs[key] - folder[key]).norm(), key
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_moe_export_holds_a_few_experts_not_a_layers_experts(tmp_path: Path) -> None:
    """64 experts of 768 KiB a layer (48 MiB), LoRA on attention and on the experts: the export reads, merges and
    writes one expert at a time; its memory rose 17 MiB with 16 experts and with 64 (the merged model's build), where
    merging a layer's fused experts whole rose 141 MiB."""
    from tests.distributed import run_script

    config = transformers.AutoConfig.for_model(
        "qwen3_moe",
        **{**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 64},
        moe_intermediate_size=256,
        num_experts=64,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "base"))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    lora = peft.LoraConfig(r=4, target_modules=QV, target_parameters=EXPERTS)
    checkpoint = write_checkpoint(Adapted(base, lora), tmp_path / "run.ckpt")
    result = run_script("moe_export_memory.py", f"--checkpoint={checkpoint}", f"--out={tmp_path}")
    layer_experts_mib = 64 * 3 * 256 * 256 * 4 / 2**20
    assert json.loads(result.stdout.splitlines()[-1])["peak_rise_mib"] < layer_experts_mib / 2
    assert saved_keys(tmp_path / "measured") == saved_keys(tmp_path / "base")


@pytest.fixture(scope="module")
def moe_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In one 2-rank world, for each of MOE_CONFIGS: a 3-step fit saving at step 2 and after step 3 (``straight``),
    then a resume of step 2 to step 3 (``resumed``); ``<kind>/base`` holds the folder, ``<kind>/<run>`` the reports."""
    from tests.distributed import chained, launch

    tmp = tmp_path_factory.mktemp("moe_two_ranks")
    runs = []
    for kind in MOE_CONFIGS:
        folder, run = moe_folder(tmp / kind / "base", kind), tmp / kind
        runs += [
            ["--folder", str(folder), "--save-at=2", f"--save={run / 'straight.ckpt'}", f"--report={run / 'straight'}"],
            ["--folder", str(folder), f"--resume={run / 'step2.ckpt'}", f"--report={run / 'resumed'}"],
        ]
    codes, outputs, seconds = launch("moe_two_rank.py", *chained(*runs), timeout=300)
    assert codes == [0], f"exited {codes} after {seconds:.0f} s:\n{outputs[0][-6000:]}"
    return tmp


def plain_loss(folder: Path, batch: list[list[int]]) -> float:
    """The loss of the plain transformers model of ``folder`` (fp32) on ``batch``."""
    tokens, plain = torch.tensor(batch), transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        return float(plain(input_ids=tokens, labels=tokens).loss)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_a_moe_fit_on_two_ranks_starts_at_the_plain_models_loss_each_rank_holding_half_the_experts(
    kind: str, moe_two_ranks: Path
) -> None:
    from tests.distributed import read_reports

    reports = read_reports(moe_two_ranks / kind / "straight")
    assert [r["rank"] for r in reports] == [0, 1] and [r["global_step"] for r in reports] == [3, 3]
    assert reports[0]["batches"][0] != reports[1]["batches"][0]  # each rank its own half of the data
    for report in reports:  # LoRA B starts at zero on attention and on the experts: PEFT's model is the plain one
        first = plain_loss(moe_two_ranks / kind / "base", report["batches"][0])
        assert report["losses"][0] == pytest.approx(first, rel=1e-5)
        assert report["losses"][-1] < report["losses"][0]
        # gate_up_proj and down_proj of 2 layers, one ZeRO-3 param each: half their bytes on each rank, offloaded
        assert report["experts"] == 4 and report["experts_device"] == "cpu"
        assert report["experts_held_bytes"] == pytest.approx(report["experts_bytes"] / 2, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_each_of_two_ranks_reads_only_its_own_range_of_the_folders_experts(kind: str, moe_two_ranks: Path) -> None:
    from tests.distributed import read_reports

    reports = read_reports(moe_two_ranks / kind / "straight")
    assert [r["zero3_loads"] for r in reports] == [0, 0]  # transformers' own loader (rank 0 reads all) never ran
    folder = folder_values(moe_two_ranks / kind / "base")
    experts = [key for key in folder if ".experts." in key]
    assert len(experts) == 2 * 4 * 3  # 2 layers of 4 experts of 3 tensors, as the folder stores them
    for key in folder:  # the two ranks' ranges of each tensor: every element read once, by one of them
        ranges = sorted((start, count) for r in reports for start, count in r["reads"].get(key, []) if count)
        assert [start for start, _ in ranges] == [0, *(start + count for start, count in ranges[:-1])], key
        assert sum(count for _, count in ranges) == folder[key].numel(), key
    elements = [sum(count for key in experts for _, count in r["reads"].get(key, [])) for r in reports]
    assert elements[0] == elements[1] == sum(folder[key].numel() for key in experts) / 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_a_moe_resume_on_two_ranks_goes_on_as_the_straight_run(kind: str, moe_two_ranks: Path) -> None:
    from tests.distributed import read_reports

    straight, resumed = (read_reports(moe_two_ranks / kind / run) for run in ("straight", "resumed"))
    assert len(resumed) == len(straight) == 2
    for ours, theirs in zip(resumed, straight):  # rank by rank: step 3's batch and loss
        assert ours["global_step"] == 3 and ours["batches"] == theirs["batches"][2:]
        assert ours["losses"] == pytest.approx(theirs["losses"][2:], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_a_two_rank_moe_checkpoint_resumes_on_one_rank_and_merges_as_peft_does(
    kind: str, moe_two_ranks: Path, tmp_path: Path
) -> None:
    folder, checkpoint = moe_two_ranks / kind / "base", moe_two_ranks / kind / "straight.ckpt"
    resumed = MoELoRA(str(folder), lr=5e-2)
    trainer = cpu_trainer(max_steps=4, max_epochs=-1, precision="32-true")
    trainer.fit(resumed, token_data(), ckpt_path=checkpoint)  # the base verified against the 2-rank fingerprint
    assert trainer.global_step == 4 and len(resumed.losses) == 1

    out = lightning_frozen.export_merged(checkpoint, tmp_path / "merged")
    merged = assert_moe_merged_as_peft(folder, checkpoint, out, tmp_path)
    batch = resumed.batches[0]
    with torch.no_grad():  # the adapter the 1-rank resume started from, on its base, is the merged model
        assert float(merged(input_ids=batch, labels=batch).loss) == pytest.approx(resumed.losses[0], rel=1e-5)

    from safetensors.torch import save_file

    changed = folder_values(folder)  # one weight of one expert, as the folder stores it
    key = next(key for key in changed if key.startswith("model.layers.1.") and ".experts.3." in key)
    changed[key] = changed[key].clone()
    changed[key][0, 0] += 1
    (tmp_path / "changed").mkdir()
    (tmp_path / "changed" / "config.json").write_text((folder / "config.json").read_text())
    save_file(changed, str(tmp_path / "changed" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FrozenBaseMismatchError, match=r"layers\.1\.mlp\.experts\.\S*_proj` holds different values"):
        cpu_trainer(max_steps=4).fit(MoELoRA(str(tmp_path / "changed")), token_data(), ckpt_path=checkpoint)
