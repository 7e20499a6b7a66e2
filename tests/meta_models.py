"""Models built on the ``meta`` device, so nothing is allocated: LLaMA-13B's shape with LoRA, for memory estimates
(the test of ``estimate_memory`` and ``benchmarks/estimate_13b/run.py`` use the same model and the same verdict)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_frozen import MemoryEstimate

GPU_BYTES = 24 * 10**9


def llama_13b_lora() -> nn.Module:
    """LLaMA-13B's shape with PEFT LoRA r=16 on q_proj/v_proj, every tensor on the ``meta`` device."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        return get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))


def fits(estimate: MemoryEstimate, gpu_bytes: int = GPU_BYTES) -> bool:
    """Whether the model states and ZeRO-3's working buffers fit the GPU, leaving activations aside."""
    return estimate.device_bytes <= gpu_bytes
