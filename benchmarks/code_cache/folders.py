"""The random-weight folders this study loads, written shard by shard (never a whole model in memory):

- :func:`write_llama_bnb_nf4`: a Llama-2-70B-shaped folder as bitsandbytes' 4-bit ``save_pretrained`` leaves it
  (``load_in_4bit``, nf4, double quantization, blocks of 64, uint8 storage): per linear weight of the decoder layers
  ``x.weight`` (uint8 ``[n/2, 1]``, two codes a byte), ``x.weight.absmax`` (uint8, one a block of 64),
  ``x.weight.quant_map`` (the 16 NF4 values), ``x.weight.nested_absmax`` (fp32, one a block of 256 scales),
  ``x.weight.nested_quant_map`` (bitsandbytes' 256-value dynamic map) and ``x.weight.quant_state.bitsandbytes__nf4``
  (the packed JSON of the rest); the embedding, the head and the norms in bf16, as transformers leaves them
  (it does not quantize the output embeddings). Codes and scale codes are random bytes, the nested scales and the
  offset those bitsandbytes gave a normal(0, 0.02) weight (absmax 0.017-0.088): no weight is ever quantized here.
  ``config.json`` carries ``BitsAndBytesConfig(...).to_dict()`` as ``quantization_config``. The key set, dtypes,
  shapes and packed state are checked against what ``bitsandbytes.functional.quantize_4bit(...).as_dict(packed=True)``
  gives for a small weight (:func:`check_bnb_layout`).
- :func:`write_qwen3_moe`: Qwen3-30B-A3B's shapes (hidden 2048, 32 query and 4 key/value heads of 128, 128 experts
  of 768, top-8, vocabulary 151,936, untied head) with ``layers`` decoder layers, bf16 normal(0, 0.02), norms 1, each
  expert's tensors apart (``mlp.experts.E.{gate,up,down}_proj.weight``) as transformers 5's ``save_pretrained``
  writes them; it fuses them at load.

Values are windows of one pool of random values drawn once (``_from_pool``: drawing 40 GB here would take longer than
the benchmark), so tensors share values; random weights are all this study needs. A marker written last records what
a folder holds; a folder whose marker matches is reused.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

SHARD_BYTES = 2 * 10**9
MARKER = ".code_cache_folder.json"
INIT_STD = 0.02
# Llama-2-70B (grouped-query attention, 8 key/value heads, untied head)
LLAMA_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# Qwen3-30B-A3B (every layer sparse)
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
LINEARS_70B = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# bitsandbytes' nested statistics as quantize_4bit gave them for a normal(0, 0.02) bf16 weight
NESTED_OFFSET, NESTED_ABSMAX = 0.0525, 0.035


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# ------------------------------------------------------------------------------------------------ shapes


def llama_linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    return {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def llama_layer_weights(config: dict[str, Any]) -> int:
    """Weights of one decoder layer's linear layers (the part bitsandbytes quantizes)."""
    return sum(numel(s) for s in llama_linear_shapes(config).values())


def bnb_nf4_bytes(n: int) -> int:
    """Bytes of bitsandbytes' 4-bit double-quantized layout for a weight of ``n`` values (packed JSON left out)."""
    blocks = -(-n // 64)
    return (n + 1) // 2 + blocks + 4 * -(-blocks // 256) + 4 * 256 + 4 * 16


def qwen3_moe_tensors(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Qwen3-MoE folder as transformers 5 saves it (experts apart), in the file's order."""
    hidden, heads, kv, head_dim = (
        config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    experts, inter, vocab = config["num_experts"], config["moe_intermediate_size"], config["vocab_size"]
    yield "model.embed_tokens.weight", (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        yield prefix + "input_layernorm.weight", (hidden,)
        yield prefix + "post_attention_layernorm.weight", (hidden,)
        yield prefix + "self_attn.q_proj.weight", (heads * head_dim, hidden)
        yield prefix + "self_attn.k_proj.weight", (kv * head_dim, hidden)
        yield prefix + "self_attn.v_proj.weight", (kv * head_dim, hidden)
        yield prefix + "self_attn.o_proj.weight", (hidden, heads * head_dim)
        yield prefix + "self_attn.q_norm.weight", (head_dim,)
        yield prefix + "self_attn.k_norm.weight", (head_dim,)
        yield prefix + "mlp.gate.weight", (experts, hidden)
        for expert in range(experts):
            yield prefix + f"mlp.experts.{expert}.gate_proj.weight", (inter, hidden)
            yield prefix + f"mlp.experts.{expert}.up_proj.weight", (inter, hidden)
            yield prefix + f"mlp.experts.{expert}.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def qwen3_moe_params(config: dict[str, Any]) -> int:
    return sum(numel(shape) for _, shape in qwen3_moe_tensors(config))


# ------------------------------------------------------------------------------------------------ writing


def _complete(folder: Path, spec: dict[str, Any]) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    files = marker.get("files", {})
    return marker.get("spec") == json.loads(json.dumps(spec)) and all(
        (folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items()
    )


def _write_shards(
    folder: Path,
    spec: dict[str, Any],
    tensors: Iterator[tuple[str, Callable[[], dict[str, Any]], int]],
    total: int,
    config_json: dict[str, Any],
    log: Callable = print,
) -> dict[str, Any]:
    """Write ``tensors`` (name, a function giving that entry's tensors, their bytes) into shards of about
    ``SHARD_BYTES``, then the index, ``config.json`` and the marker."""
    from safetensors.torch import save_file

    if _complete(folder, spec):
        log(f"{folder}: complete, reused")
        return json.loads((folder / MARKER).read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    free = shutil.disk_usage(folder).free
    if free < total * 1.02:
        raise OSError(f"{folder}: {total / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free")
    plans: list[list[tuple[str, Callable[[], dict[str, Any]]]]] = [[]]
    size = 0
    for name, make, nbytes in tensors:
        if plans[-1] and size + nbytes > SHARD_BYTES:
            plans.append([])
            size = 0
        plans[-1].append((name, make))
        size += nbytes
    weight_map, files = {}, {}
    for index, plan in enumerate(plans, start=1):
        file_name = f"model-{index:05d}-of-{len(plans):05d}.safetensors"
        shard: dict[str, Any] = {}
        for _, make in plan:
            shard.update(make())
        partial = folder / (file_name + ".partial")
        save_file(shard, partial, metadata={"format": "pt"})
        os.replace(partial, folder / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
        del shard
        files[file_name] = (folder / file_name).stat().st_size
        log(f"{folder}: wrote {file_name} ({files[file_name] / 2**30:.2f} GiB)")
    index_json = {"metadata": {"total_size": sum(files.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")
    (folder / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    for name in ("model.safetensors.index.json", "config.json"):
        files[name] = (folder / name).stat().st_size
    marker = {"spec": spec, "bytes": sum(files.values()), "files": files}
    (folder / MARKER).write_text(json.dumps(marker, indent=1))
    return marker


POOL_VALUES = 2**27  # values drawn once; each tensor is a window of them (see _from_pool)
_POOLS: dict[str, Any] = {}


def _pool(kind: str) -> Any:
    """The values every tensor of ``kind`` is cut from: ``normal`` bf16 normal(0, 0.02), or random ``bytes``."""
    import torch

    if kind not in _POOLS:
        generator = torch.Generator().manual_seed(0)
        if kind == "normal":
            _POOLS[kind] = torch.empty(POOL_VALUES, dtype=torch.bfloat16).normal_(0.0, INIT_STD, generator=generator)
        else:
            _POOLS[kind] = torch.randint(0, 256, (2 * POOL_VALUES,), dtype=torch.uint8, generator=generator)
    return _POOLS[kind]


def _from_pool(kind: str, name: str, count: int) -> Any:
    """``count`` values of the pool ``kind`` from an offset given by ``name``, wrapping around: drawing 40 GB of
    random numbers here would take longer than the benchmark (torch's normal_ gives 115 M bf16 values/s on one core),
    and a copy runs at memory speed. Random weights are all the benchmark needs; tensors share values."""
    import torch

    pool = _pool(kind)
    start = zlib.crc32(name.encode()) % len(pool)
    out = torch.empty(count, dtype=pool.dtype)
    done = 0
    while done < count:
        take = min(count - done, len(pool) - start)
        out[done : done + take] = pool[start : start + take]
        done, start = done + take, 0
    return out


def _normal_bf16(name: str, shape: tuple[int, ...]) -> Any:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return _from_pool("normal", name, numel(shape)).view(shape)


def _random_bytes(name: str, count: int) -> Any:
    return _from_pool("bytes", name, count)


def bnb_templates() -> dict[str, Any]:
    """bitsandbytes' NF4 code values, its nested dynamic map and its ``pack_dict_to_tensor``, from the installed
    bitsandbytes (``.venv/tests-only``)."""
    import torch
    from bitsandbytes import functional

    generator = torch.Generator().manual_seed(0)
    weight = torch.empty(128, 256, dtype=torch.bfloat16).normal_(0, INIT_STD, generator=generator)
    _, state = functional.quantize_4bit(
        weight, blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8
    )
    return {"state": state.as_dict(packed=True), "pack": functional.pack_dict_to_tensor}


def bnb_entry(name: str, shape: tuple[int, int], templates: dict[str, Any]) -> dict[str, Any]:
    """The tensors bitsandbytes' ``save_pretrained`` writes for the 4-bit linear weight ``name`` of ``shape``."""
    import torch

    n = numel(shape)
    blocks = -(-n // 64)
    nested = -(-blocks // 256)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    absmax_scales = torch.empty(nested, dtype=torch.float32).normal_(0, 0.004, generator=generator) + NESTED_ABSMAX
    packed_state = templates["pack"](
        {
            "quant_type": "nf4",
            "blocksize": 64,
            "dtype": "bfloat16",
            "shape": list(shape),
            "nested_blocksize": 256,
            "nested_dtype": "float32",
            "nested_offset": NESTED_OFFSET,
        }
    )
    state = templates["state"]
    return {
        name: _random_bytes(name, (n + 1) // 2).view((n + 1) // 2, 1),
        name + ".absmax": _random_bytes(name + ".absmax", blocks),
        name + ".quant_map": state["quant_map"].clone(),
        name + ".nested_absmax": absmax_scales,
        name + ".nested_quant_map": state["nested_quant_map"].clone(),
        name + ".quant_state.bitsandbytes__nf4": packed_state,
    }


def check_bnb_layout() -> list[str]:
    """Problems of :func:`bnb_entry` against ``quantize_4bit(...).as_dict(packed=True)`` for one small weight: other
    keys, dtypes or shapes, or a packed state that unpacks to other fields."""
    import torch
    from bitsandbytes import functional

    templates = bnb_templates()
    ours = bnb_entry("w.weight", (128, 256), templates)
    theirs = {"w.weight": torch.empty(128 * 256 // 2, 1, dtype=torch.uint8)}
    theirs.update({f"w.weight.{k}": v for k, v in templates["state"].items()})
    problems = [f"keys differ: {sorted(set(ours) ^ set(theirs))}"] if set(ours) != set(theirs) else []
    for key in set(ours) & set(theirs):
        if ours[key].dtype != theirs[key].dtype or (ours[key].shape != theirs[key].shape and "quant_state" not in key):
            problems.append(
                f"{key}: {ours[key].dtype} {tuple(ours[key].shape)} against "
                f"{theirs[key].dtype} {tuple(theirs[key].shape)}"
            )
    mine = functional.unpack_tensor_to_dict(ours["w.weight.quant_state.bitsandbytes__nf4"])
    real = functional.unpack_tensor_to_dict(theirs["w.weight.quant_state.bitsandbytes__nf4"])
    if set(mine) != set(real) or any(mine[k] != real[k] for k in mine if k != "nested_offset"):
        problems.append(f"packed state {mine} against {real}")
    return problems


def llama_bnb_config(fields: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import BitsAndBytesConfig, LlamaConfig

    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.uint8,
    )
    data = json.loads(config.to_json_string(use_diff=False))
    data["quantization_config"] = json.loads(json.dumps(quantization.to_dict()))
    return data


def write_llama_bnb_nf4(
    folder: Path, layers: int, log: Callable = print, shape: Optional[dict[str, int]] = None
) -> dict[str, Any]:
    """The Llama-2-70B-shaped pre-quantized folder with ``layers`` decoder layers (see the module's docstring);
    ``shape`` replaces config fields (a small folder to check the plumbing)."""
    config = dict(LLAMA_70B, **(shape or {}), num_hidden_layers=layers)
    templates = bnb_templates()
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    linears = llama_linear_shapes(config)

    def plain(name: str, shape: tuple[int, ...]) -> tuple[str, Callable[[], dict[str, Any]], int]:
        return name, lambda: {name: _normal_bf16(name, shape)}, 2 * numel(shape)

    def entries() -> Iterator[tuple[str, Callable[[], dict[str, Any]], int]]:
        yield plain("model.embed_tokens.weight", (vocab, hidden))
        for layer in range(layers):
            prefix = f"model.layers.{layer}."
            yield plain(prefix + "input_layernorm.weight", (hidden,))
            yield plain(prefix + "post_attention_layernorm.weight", (hidden,))
            for module, shape in linears.items():
                name = prefix + module + ".weight"
                yield (
                    name,
                    (lambda name=name, shape=shape: bnb_entry(name, shape, templates)),
                    bnb_nf4_bytes(numel(shape)),
                )
        yield plain("model.norm.weight", (hidden,))
        yield plain("lm_head.weight", (vocab, hidden))

    total = 4 * vocab * hidden + layers * sum(bnb_nf4_bytes(numel(s)) for s in linears.values())
    spec = {"kind": "llama-bnb-nf4", "config": config, "format": 2}
    return _write_shards(folder, spec, entries(), total, llama_bnb_config(config), log)


def write_qwen3_moe(
    folder: Path, layers: int, log: Callable = print, shape: Optional[dict[str, int]] = None
) -> dict[str, Any]:
    """The Qwen3-30B-A3B-shaped bf16 folder with ``layers`` decoder layers; ``shape`` replaces config fields."""
    import torch
    from transformers import Qwen3MoeConfig

    config = dict(QWEN3_30B_A3B, **(shape or {}), num_hidden_layers=layers)
    entries = (
        (name, (lambda name=name, shape=shape: {name: _normal_bf16(name, shape)}), 2 * numel(shape))
        for name, shape in qwen3_moe_tensors(config)
    )
    hf_config = Qwen3MoeConfig(**config)
    hf_config.architectures = ["Qwen3MoeForCausalLM"]
    hf_config.dtype = torch.bfloat16
    spec = {"kind": "qwen3-moe-bf16", "config": config, "format": 2}
    config_json = json.loads(hf_config.to_json_string(use_diff=False))
    return _write_shards(folder, spec, entries, 2 * qwen3_moe_params(config), config_json, log)
