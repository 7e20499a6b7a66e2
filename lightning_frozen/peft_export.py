"""Export an adapter checkpoint to PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

At save time PEFT's own ``get_peft_model_state_dict`` maps our parameter names to PEFT's adapter keys; the
mapping is stored in the checkpoint, so export needs neither the model nor its base.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_frozen.checkpoint import PathLike, checked_path, read_checkpoint, write_file_atomic
from lightning_frozen.errors import CheckpointFormatError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def _json_plain(obj: Any) -> Any:
    """PEFT configs hold enums and sets: make them JSON (and ``weights_only``) friendly."""
    if isinstance(obj, enum.Enum):
        return _json_plain(obj.value)
    if isinstance(obj, dict):
        return {str(k): _json_plain(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(_json_plain(v) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [_json_plain(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def peft_entry(prefix: str, peft_model: Any, trainable_names: list[str]) -> dict[str, Any]:
    """What the checkpoint keeps to export later: the adapter config and ``{our name: PEFT key}``."""
    from peft import get_peft_model_state_dict

    adapter_name = peft_model.active_adapter
    config = _json_plain(peft_model.peft_config[adapter_name].to_dict())
    lead = f"{prefix}." if prefix else ""
    ours = [name for name in trainable_names if name.startswith(lead)]
    probe = {name[len(lead) :]: torch.tensor([index]) for index, name in enumerate(ours)}
    mapped = get_peft_model_state_dict(
        peft_model, state_dict=probe, adapter_name=adapter_name, save_embedding_layers=False
    )
    keys = {ours[int(value.item())]: key for key, value in mapped.items()}
    left_out = sorted(set(trainable_names) - set(keys))
    return {"prefix": prefix, "adapter_name": adapter_name, "config": config, "keys": keys, "not_in_adapter": left_out}


def _inside(folder: Path, name: str) -> Path:
    target = (folder / name).resolve()
    if target.parent != folder.resolve():
        raise ValueError(
            f"{folder / name} links to {target}, outside {folder}; the export writes only inside its folder. Remove"
            " the link or choose another `output_dir`."
        )
    return target


def export_peft_adapter(checkpoint_path: PathLike, output_dir: PathLike) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` for ``peft.PeftModel.from_pretrained``.

    Only the two files are written, inside ``output_dir`` (created if needed), each atomically through a new
    temporary file: never through a link planted there. Trainable parameters that are not part of the PEFT adapter
    (a head outside the ``PeftModel``) cannot go into it and are named in a warning. Returns ``output_dir``.

    Raises:
        TypeError: ``checkpoint_path`` or ``output_dir`` is not a path.
        CheckpointFormatError: the checkpoint was not trained on a PEFT model, or is not a lightning-frozen file.
        NotADirectoryError: ``output_dir`` exists and is a file.
        ValueError: one of the two files in ``output_dir`` is a link to somewhere else.
    """
    from safetensors.torch import save

    checkpoint_path = checked_path(checkpoint_path, "checkpoint_path", "export_peft_adapter")
    folder = checked_path(output_dir, "output_dir", "export_peft_adapter")
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} exists and is not a directory; choose a folder for the PEFT adapter.")
    checkpoint = read_checkpoint(checkpoint_path)
    peft = checkpoint["frozen_base"].get("peft")
    if not peft:
        raise CheckpointFormatError(
            f"{checkpoint_path} was not trained on a PEFT model (no `frozen_base['peft']` entry), so it has no PEFT"
            " adapter to export. Load it with `lightning_frozen.load_adapter` instead."
        )
    folder.mkdir(parents=True, exist_ok=True)
    state_dict = checkpoint["state_dict"]
    missing = sorted(name for name in peft["keys"] if name not in state_dict)
    if missing:
        raise CheckpointFormatError(f"{checkpoint_path} lacks adapter weights {missing[:5]}; the file is damaged.")
    if peft.get("not_in_adapter"):
        rank_zero_warn(
            f"lightning-frozen: {len(peft['not_in_adapter'])} trainable tensors are outside the PEFT model and not in"
            f" the exported adapter: {peft['not_in_adapter'][:5]}. Put them in the PEFT config's `modules_to_save`"
            " to export them too."
        )
    tensors = {key: state_dict[name].detach().contiguous() for name, key in peft["keys"].items()}
    config = dict(peft["config"])
    if checkpoint["frozen_base"].get("reference") and not config.get("base_model_name_or_path"):
        config["base_model_name_or_path"] = checkpoint["frozen_base"]["reference"]
    weights_path = _inside(folder, WEIGHTS_NAME)
    config_path = _inside(folder, CONFIG_NAME)
    weights = save(tensors, metadata={"format": "pt"})
    write_file_atomic(weights_path, lambda handle: handle.write(weights))
    write_file_atomic(config_path, lambda handle: handle.write(json.dumps(config, indent=2, sort_keys=True).encode()))
    return folder
