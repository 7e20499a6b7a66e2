"""Does a 13B model with LoRA at 0.1% trainable fit one 24 GB GPU under ``frozen_deepspeed``?

    python benchmarks/estimate_13b.py

Builds a LLaMA-13B-shaped model (transformers' ``LlamaForCausalLM``: 40 layers, hidden 5120, vocab 32000) with
PEFT LoRA r=16 on ``q_proj``/``v_proj`` (13.1M trainable, 0.10%) on the ``meta`` device, so nothing is
allocated, and prints :func:`lightning_frozen.estimate_memory` in bf16 on one GPU, with the frozen base in CPU
memory (``frozen_deepspeed``) and on the GPU (``frozen_deepspeed_no_offload``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_frozen import MemoryEstimate, estimate_memory  # noqa: E402
from lightning_frozen.memory import format_bytes  # noqa: E402

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


def main() -> None:
    model = llama_13b_lora()
    for offload_frozen in (True, False):
        print(f"\nbf16-mixed, 1 GPU, offload_frozen={offload_frozen}:")
        estimate = estimate_memory(model, precision="bf16-mixed", offload_frozen=offload_frozen)
        verdict = "fits" if fits(estimate) else "does not fit"
        print(
            f"-> {format_bytes(estimate.device_bytes)} on the GPU {verdict} in 24 GB,"
            f" {format_bytes(estimate.host_bytes)} in CPU memory, activations not counted."
        )


if __name__ == "__main__":
    main()
