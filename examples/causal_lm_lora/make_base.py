"""Write the example's frozen base: a small Llama-architecture causal LM with random weights, as a
``save_pretrained`` folder (``config.json`` + ``model.safetensors``, bf16), like a checkpoint from the Hub.

No weights can be downloaded here, so the example makes its own; ``task.py`` loads the folder exactly as it would
load ``meta-llama/...`` or any other hub checkpoint. The tests and benchmarks write their Llamas with
``write_random_llama`` too, each with its own config.

    python examples/causal_lm_lora/make_base.py [FOLDER]     (default: outputs/causal_lm_lora/base)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

DEFAULT_FOLDER = Path("outputs", "causal_lm_lora", "base")
# 4 layers of width 256 over a 256-token vocabulary: 3,295,488 params, 6.3 MiB in bf16
BASE_CONFIG = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
)


def write_random_llama(
    folder: Path, config: dict[str, Any], dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> torch.nn.Module:
    """Save a ``LlamaForCausalLM(LlamaConfig(**config))`` initialised from ``seed``, cast to ``dtype``, to ``folder``
    with ``save_pretrained``; returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype)
    model.save_pretrained(folder)
    return model


def write_base(folder: Path = DEFAULT_FOLDER) -> Path:
    """Save the example's base (``BASE_CONFIG``, bf16) to ``folder``; returns ``folder``."""
    write_random_llama(folder, BASE_CONFIG)
    return folder


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER
    print(f"wrote {write_base(target)}")
