"""Does a 13B model with LoRA at 0.1% trainable fit one 24 GB GPU under ``frozen_deepspeed``?

    python benchmarks/estimate_13b/run.py

Builds a LLaMA-13B-shaped model (transformers' ``LlamaForCausalLM``: 40 layers, hidden 5120, vocab 32000) with
PEFT LoRA r=16 on ``q_proj``/``v_proj`` (13.1M trainable, 0.10%) on the ``meta`` device, so nothing is
allocated, and prints :func:`lightning_frozen.estimate_memory` in bf16 on one GPU, with the frozen base in CPU
memory (``frozen_deepspeed``) and on the GPU (``frozen_deepspeed_no_offload``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_frozen import estimate_memory  # noqa: E402
from lightning_frozen.memory import format_bytes  # noqa: E402
from tests.meta_models import fits, llama_13b_lora  # noqa: E402


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
