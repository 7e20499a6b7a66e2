"""A Llama-2-shaped Hugging Face checkpoint folder, written shard by shard without building the model.

The folder is what ``LlamaForCausalLM.save_pretrained`` writes: ``config.json`` (``LlamaConfig`` fields, bf16),
``model-0000k-of-0000n.safetensors`` shards of about ``shard_bytes`` each (filled in ``state_dict`` order) and
``model.safetensors.index.json``. Tensor names and shapes come from transformers' ``LlamaForCausalLM`` built on the
``meta`` device (untied ``lm_head``), so they are exactly the library's. Values are random bf16, deterministic per
tensor: normal(0, 0.02) from a generator seeded by the tensor's name, norm weights 1 (transformers' own init).
Only one shard is in memory at a time. A marker file written last records what the folder holds; a folder whose
marker matches is reused as it is.

``python benchmarks/big_model/run.py check-writer`` loads a small folder with ``AutoModelForCausalLM.from_pretrained``
(no DeepSpeed) and checks every key and value: that is how we know the writer is right.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

# Llama-2 shapes (multi-head attention, untied head); "tiny" is for checking the plumbing
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, vocab_size=32000),
    # TinyLlama-1.1B's shape (grouped-query attention: 4 key/value heads), for benchmarks/peer_qlora/run.py
    "1.1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "7b": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000
    ),
    "13b": dict(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, vocab_size=32000
    ),
    # for the arithmetic only (grouped-query attention: 8 key/value heads)
    "70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
}
# the command-line overrides and the LlamaConfig field each one replaces
OVERRIDES = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "heads": "num_attention_heads",
    "vocab": "vocab_size",
}
SHARD_BYTES = 2 * 10**9  # hub checkpoints of Llama-2 come in shards of a few GB
TINY_SHARD_BYTES = 10 * 10**6  # so that the tiny folder has several shards and an index too
MARKER = ".big_model_complete.json"
INIT_STD = 0.02  # LlamaConfig's initializer_range


def llama_config(size: str, overrides: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """``LlamaConfig`` arguments of ``size`` with ``overrides`` (keys of ``OVERRIDES``) applied: Llama-2's norm epsilon
    and context length, untied embeddings, bf16."""
    config: dict[str, Any] = dict(SIZES[size])
    for key, value in (overrides or {}).items():
        config[OVERRIDES[key]] = value
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    return dict(
        config,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def size_key(size: str, overrides: Optional[dict[str, int]] = None) -> str:
    """A name for ``size`` with ``overrides``: ``7b``, or ``7b-layers4-hidden2048``."""
    return "-".join([size, *(f"{key}{value}" for key, value in sorted((overrides or {}).items()))])


def shard_bytes_for(size: str) -> int:
    """The shard size of ``size``'s folder: a few GB as on the hub, small for ``tiny`` so that it has an index."""
    return TINY_SHARD_BYTES if size == "tiny" else SHARD_BYTES


def tensor_specs(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of ``LlamaForCausalLM(LlamaConfig(**config))``'s state dict, in its order (meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return [(name, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]


def param_count(config: dict[str, Any]) -> int:
    """Parameters of the model of ``config``."""
    return sum(_numel(shape) for _, shape in tensor_specs(config))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def plan_shards(specs: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split the tensors, in order, into shards of at most ``shard_bytes`` in bf16 (a larger tensor gets its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def tensor_values(name: str, shape: tuple[int, ...], seed: int = 0) -> Any:
    """The bf16 values of tensor ``name``: 1 for norm weights, else normal(0, 0.02) seeded by ``seed`` and the name."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, INIT_STD, generator=generator)


def _spec(config: dict[str, Any], shard_bytes: int, seed: int) -> dict[str, Any]:
    return {"config": config, "shard_bytes": shard_bytes, "seed": seed, "format": 1}


def complete(folder: Path, config: dict[str, Any], shard_bytes: int, seed: int = 0) -> bool:
    """Whether ``folder`` holds the complete checkpoint of ``config`` (its marker matches, every file has its size)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("spec") != json.loads(json.dumps(_spec(config, shard_bytes, seed))):
        return False
    files = marker.get("files", {})
    return bool(files) and all(
        (folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items()
    )


def shard_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files (shards, or the one file a small model is saved in), in order."""
    return sorted(folder.glob("model*.safetensors"))


def write_checkpoint(
    folder: Path, config: dict[str, Any], shard_bytes: int = SHARD_BYTES, seed: int = 0, log: Callable = print
) -> dict[str, Any]:
    """Write the checkpoint of ``config`` to ``folder`` unless it is complete there already; return its marker.

    Raises:
        OSError: the file system lacks room for it (the message says how much it needs).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    if complete(folder, config, shard_bytes, seed):
        log(f"{folder}: complete, reused")
        return json.loads((folder / MARKER).read_text())
    specs = tensor_specs(config)
    total = sum(2 * _numel(shape) for _, shape in specs)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*shard_files(folder), folder / MARKER, folder / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    free = shutil.disk_usage(folder).free
    if free < total * 1.02:
        raise OSError(
            f"{folder}: {total / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free; free space or pass"
            " another --data-dir."
        )
    shards = plan_shards(specs, shard_bytes)
    weight_map, files = {}, {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: tensor_values(key, shape, seed) for key, shape in shard}
        partial = folder / (name + ".partial")
        save_file(tensors, partial, metadata={"format": "pt"})
        os.replace(partial, folder / name)
        del tensors  # one shard in memory at a time
        files[name] = (folder / name).stat().st_size
        weight_map.update({key: name for key, _ in shard})
        log(f"{folder}: wrote {name} ({files[name] / 2**30:.2f} GiB)")
    index_json = {"metadata": {"total_parameters": total // 2, "total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")
    llama = LlamaConfig(**config)
    llama.architectures = ["LlamaForCausalLM"]
    llama.dtype = torch.bfloat16
    llama.save_pretrained(folder)
    for name in ("model.safetensors.index.json", "config.json"):
        files[name] = (folder / name).stat().st_size
    marker = {"spec": _spec(config, shard_bytes, seed), "params": total // 2, "bytes": total, "files": files}
    (folder / MARKER).write_text(json.dumps(marker, indent=1))
    return marker


def check_writer(folder: Path, log: Callable = print) -> list[str]:
    """Write the tiny checkpoint to ``folder`` and load it with ``from_pretrained`` (no DeepSpeed); return the
    problems found: missing, unexpected or mismatched keys, a tensor that is not bf16 or differs from what the
    writer generated, a single shard, or a folder not reused on the second call."""
    import torch
    from transformers import AutoModelForCausalLM

    config = llama_config("tiny")
    write_checkpoint(folder, config, TINY_SHARD_BYTES, log=log)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    problems = [f"{kind}: {keys}" for kind, keys in info.items() if keys]
    state = model.state_dict()
    specs = tensor_specs(config)
    if set(state) != {name for name, _ in specs}:
        problems.append(f"keys differ: {sorted(set(state) ^ {name for name, _ in specs})}")
    for name, shape in specs:
        if name in state and not (
            state[name].dtype == torch.bfloat16 and torch.equal(state[name], tensor_values(name, shape))
        ):
            problems.append(f"{name}: {state[name].dtype} values differ from the writer's")
    if len(shard_files(folder)) < 2:
        problems.append("one shard only: the index was not exercised")
    reused: list[str] = []
    write_checkpoint(folder, config, TINY_SHARD_BYTES, log=reused.append)
    if not (reused and reused[0].endswith("reused")):
        problems.append("a complete folder was written again instead of reused")
    return problems
