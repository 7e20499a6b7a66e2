"""A Llama-architecture base written with ``save_pretrained`` and a LightningModule that loads it the way users do:
``AutoModelForCausalLM.from_pretrained(folder)`` and ``get_peft_model`` inside ``configure_model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

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

    lora_targets = ["q_proj", "v_proj"]

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(self.load_base(), LoraConfig(r=4, target_modules=self.lora_targets))

    def load_base(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.hparams.folder)

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
    frozen_equal, lora_b_zero, shards, buffers, not_in_folder = {}, {}, {}, {}, {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            full = param.detach().cpu().clone()
        key = name.removeprefix("model.base_model.model.").replace(".base_layer", "")
        if not param.requires_grad and key not in reference:  # initialised by transformers: its sum and spread
            not_in_folder[key] = [float(full.double().sum()), float(full.double().std())]
        elif not param.requires_grad:
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
    return {
        "frozen_equal": frozen_equal,
        "lora_b_zero": lora_b_zero,
        "shards": shards,
        "buffers": buffers,
        "not_in_folder": not_in_folder,
    }


def token_data(samples: int = 8, length: int = 12, batch_size: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (samples, length), generator=generator)), batch_size)


class QLoRA(PretrainedLoRA):
    """PEFT's DeepSpeed guide, unchanged: the base loaded 4-bit with bitsandbytes in ``configure_model``
    (``quantization="fp4"`` or ``bnb={"llm_int8_skip_modules": [...]}`` change one setting; ``quantization=None``
    loads it plainly; ``kbit_training`` adds ``prepare_model_for_kbit_training``). Records each step's loss."""

    def __init__(
        self,
        folder: str,
        lr: float = 1e-2,
        quantization: Any = "nf4",
        kbit_training: bool = False,
        in_init: bool = False,
        bnb: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(folder, lr)
        self.save_hyperparameters()
        self.losses: list[float] = []
        if in_init:
            self.configure_model()

    def quantization_config(self) -> Any:
        from transformers import BitsAndBytesConfig

        quantization = self.hparams.quantization
        if quantization is None:
            return None
        if quantization == "int8":
            return BitsAndBytesConfig(load_in_8bit=True, **(self.hparams.bnb or {}))
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quantization,
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16,
            **(self.hparams.bnb or {}),
        )

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
        from transformers import AutoModelForCausalLM

        q = self.quantization_config()
        base = AutoModelForCausalLM.from_pretrained(self.hparams.folder, quantization_config=q, dtype=torch.bfloat16)
        if self.hparams.kbit_training:
            base = prepare_model_for_kbit_training(base)
            self.prepared = {n: (p.numel(), getattr(p, "ds_tensor", p).dtype) for n, p in base.named_parameters()}
        self.model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_start(self) -> None:
        self.seen_at_start = held_frozen(self)


def held_frozen(module: L.LightningModule) -> dict[str, Any]:
    """Each frozen param as a rank holds it: the sha256 of its stored shard and its dtype, and whether its gathered
    value on this rank's range is the folder's value quantized there (decode(encode(...)) of the slice, as each rank
    encodes its own range); the fingerprint; how many tensors were quantized as they were read; the LoRA B weights."""
    import hashlib

    import deepspeed

    from lightning_frozen.format import codec
    from lightning_frozen.zero.params import shard_range

    reference = folder_tensors(Path(module.hparams.folder))
    strategy = module.trainer.strategy
    codes, quantized_equal, lora_b = {}, {}, {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            if "lora_B" in name:
                with deepspeed.zero.GatheredParameters([param]):
                    lora_b[name] = param.detach().float().clone()
            continue
        shard = param.ds_tensor
        codes[name] = [
            str(shard.dtype),
            hashlib.sha256(shard.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
        ]
        start, count = shard_range(param)
        with deepspeed.zero.GatheredParameters([param]):
            held = param.detach().flatten()[start : start + count].clone()
        source = reference[name.removeprefix("model.base_model.model.").replace(".base_layer", "")].flatten()
        frozen_dtype = strategy.frozen_dtype
        expected = codec.decode(
            codec.encode(source[start : start + count], frozen_dtype), count, frozen_dtype, held.dtype
        )
        quantized_equal[name] = torch.equal(held, expected)
    return {
        "codes": codes,
        "quantized_equal": quantized_equal,
        "lora_b": lora_b,
        "frozen_dtype": strategy.frozen_dtype,
        "fingerprint": strategy.frozen_base_fingerprint()["digest"],
        "quantized_at_load": strategy._loaded_base.quantized_at_load,
    }


# tiny random-weight MoE bases as transformers 5 writes them: each expert's tensors in the folder, fused at load
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3_moe": dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=16),
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def moe_folder(folder: Path, kind: str, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny ``kind`` MoE (``MOE_CONFIGS``) with random weights, written in ``dtype`` with ``save_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, **TINY_LLAMA, **MOE_CONFIGS[kind])
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(str(folder))
    return folder


class MoELoRA(PretrainedLoRA):
    """LoRA on attention and on the fused experts themselves (PEFT's ``target_parameters``). Records each step's batch
    and loss and, at the end, the experts' LoRA B weights (PEFT starts them at zero)."""

    def __init__(self, folder: str, lr: float = 1e-2) -> None:
        super().__init__(folder, lr)
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.experts_lora_b: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, target_modules=self.lora_targets, target_parameters=EXPERTS)
        self.model = get_peft_model(self.load_base(), config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.batches.append(batch[0].clone())
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_end(self) -> None:
        import deepspeed

        for name, param in self.named_parameters():
            if "experts" in name and "lora_B" in name:
                with deepspeed.zero.GatheredParameters([param]):
                    self.experts_lora_b[name] = param.detach().float().clone()


class ExpertsLoRA(MoELoRA):
    """LoRA on the fused experts alone (no target module), as a MoE user trains it: no input of the first MoE block
    requires grad."""

    lora_targets: list[str] = []


class HeldMoE(MoELoRA):
    """:class:`MoELoRA` that keeps, at the start of training, what this rank holds of each frozen param
    (:func:`held_moe`), and layer 0's fused ``gate_up_proj`` as a gather in ``configure_model`` gave it (before setup:
    exact, also where it was stored as codes as it was read); with ``train_expert``, LoRA on attention only and layer
    0's experts' ``down_proj`` trained whole (its exact values are read back from the folder at setup)."""

    def __init__(self, folder: str, lr: float = 1e-2, train_expert: bool = False) -> None:
        super().__init__(folder, lr)
        self.train_expert = train_expert
        self.held: dict[str, Any] = {}
        self.gathered_before_setup: Optional[torch.Tensor] = None

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        if not self.train_expert:
            super().configure_model()
        else:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.load_base(), LoraConfig(r=4, target_modules=self.lora_targets))
            self.model.base_model.model.model.layers[0].mlp.experts.down_proj.requires_grad_(True)
        import deepspeed

        wanted = "model.layers.0.mlp.experts.gate_up_proj"
        (param,) = [p for name, p in self.model.named_parameters(prefix="model") if plain_name(name) == wanted]
        with deepspeed.zero.GatheredParameters([param]):
            self.gathered_before_setup = param.detach().clone()

    def on_train_start(self) -> None:
        self.held = held_moe(self)


def plain_name(name: str) -> str:
    """A param's name in the plain transformers model: without PEFT's prefix and wrappers."""
    return name.removeprefix("model.base_model.model.").replace(".base_layer", "")


def held_moe(module: L.LightningModule) -> dict[str, Any]:
    """What this rank holds of ``module``'s base: each param gathered whole (``values``) and each frozen one's shard as
    stored, codes or values (``shards``: the shard, its range and padded size), by its name in the plain model; the
    fingerprint, and that of a pass over the shards without the loader's record (``None`` when they hold codes); the
    frozen params whose checksum the loader recorded as it read them."""
    import deepspeed

    from lightning_frozen.base import fingerprint
    from lightning_frozen.zero.params import shard_numel, shard_range

    strategy = module.trainer.strategy
    values, shards, recorded = {}, {}, []
    for name, param in module.named_parameters():
        if "lora_" in name:
            continue
        with deepspeed.zero.GatheredParameters([param]):
            values[plain_name(name)] = param.detach().clone()
        if not param.requires_grad:
            shards[plain_name(name)] = (param.ds_tensor.detach().clone(), shard_range(param), shard_numel(param))
            if strategy._loaded_base.checksum(param) is not None:
                recorded.append(plain_name(name))
    named = fingerprint.named_frozen(module)
    return {
        "values": values,
        "shards": shards,
        "recorded": recorded,
        "fingerprint": strategy.frozen_base_fingerprint()["digest"],
        "fingerprint_by_a_pass": None
        if strategy.frozen_dtype
        else fingerprint.fingerprint_base(named, strategy.fingerprint)["digest"],
        "quantized_at_load": strategy._loaded_base.quantized_at_load,
    }
