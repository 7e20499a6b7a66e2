"""A Llama-architecture base written with ``save_pretrained`` and a LightningModule that loads it the way users do:
``AutoModelForCausalLM.from_pretrained(folder)`` and ``get_peft_model`` inside ``configure_model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_frozen  # noqa: F401  (registers the strategy names)
from examples.causal_lm_lora.make_base import write_random_llama

VOCAB = 256
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=120,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)


def write_llama(folder: Path, dtype: torch.dtype = torch.bfloat16, safe_serialization: bool = True) -> Path:
    """A randomly initialised Llama saved like a hub checkpoint (config.json + model.safetensors)."""
    write_random_llama(folder, TINY_LLAMA, dtype)
    if not safe_serialization:  # transformers 5 writes safetensors only; older hub checkpoints are torch.save files
        torch.save(folder_tensors(folder), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    return folder


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, from ``model.safetensors`` or ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    if (folder / "model.safetensors").exists():
        return load_file(str(folder / "model.safetensors"))
    return torch.load(folder / "pytorch_model.bin", weights_only=True)


class PretrainedLoRA(L.LightningModule):
    """LoRA on q/v of a causal LM that ``configure_model`` loads from ``folder``."""

    def __init__(self, folder: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seen_at_start: dict[str, Any] = {}

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.hparams.folder)
        self.model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

    def on_train_start(self) -> None:
        self.seen_at_start = describe(self)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def describe(module: L.LightningModule) -> dict[str, Any]:
    """What each rank holds once setup is done: every frozen weight compared with the folder's, bit for bit, the
    LoRA B matrices (PEFT starts them at zero), and where and in which dtype the shards and buffers live."""
    import deepspeed

    reference = folder_tensors(Path(module.hparams.folder))
    frozen_equal, lora_b_zero, shards, buffers = {}, {}, {}, {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            full = param.detach().cpu().clone()
        key = name.removeprefix("model.base_model.model.").replace(".base_layer", "")
        if not param.requires_grad:
            frozen_equal[key] = torch.equal(full.to(reference[key].dtype), reference[key])
        if "lora_B" in name:
            lora_b_zero[name] = bool((full == 0).all())
        shards[name] = {
            "trainable": param.requires_grad,
            "numel": int(param.ds_numel),
            "shard_numel": int(param.ds_tensor.numel()),
            "device": param.ds_tensor.device.type,
            "dtype": str(param.ds_tensor.dtype).replace("torch.", ""),
        }
    for name, buffer in module.named_buffers():
        buffers[name] = buffer.device.type
    return {"frozen_equal": frozen_equal, "lora_b_zero": lora_b_zero, "shards": shards, "buffers": buffers}


def token_data(samples: int = 8, length: int = 12, batch_size: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (samples, length), generator=generator)), batch_size)
