"""The adapter checkpoint file: build, write atomically, read, validate, and load for use without DeepSpeed.

One file, whatever the number of ranks that wrote it, that ``torch.load(path, weights_only=True)`` opens:

- Lightning's usual keys (``epoch``, ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``,
  ``hyper_parameters``, ...);
- ``state_dict``: the trainable parameters (fp32 master values) and persistent buffers, never a frozen weight;
- ``optimizer_states``: ``[{"state": {param name: {key: whole tensor or scalar}}, "param_groups": [...]}]``,
  keyed by parameter name so that any world size can resume; the fp32 weights are not stored twice;
- ``frozen_base``: ``reference``, ``fingerprint`` and, for PEFT models, the adapter config and key mapping;
- ``lightning_frozen``: the format version.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_frozen import base
from lightning_frozen.errors import CheckpointFormatError, CheckpointKeysError

FORMAT_KEY = "lightning_frozen"
FORMAT_VERSION = 1
OPTIMIZER_LAYOUT = "by_name"

PathLike = Union[str, os.PathLike]
ModuleT = TypeVar("ModuleT", bound=nn.Module)

_SAFE_SCALARS = (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


# ---------------------------------------------------------------------------------------------- plain types


def to_plain(obj: Any, where: str = "checkpoint") -> Any:
    """Convert ``obj`` to what ``torch.load(weights_only=True)`` accepts: tensors, containers and plain scalars.

    Dict subclasses become dicts, enums their values, sets sorted lists, paths strings. Anything else is
    replaced by its ``repr`` with a warning naming where it sat, so no pickled class ends up in the file.
    """
    if torch.is_tensor(obj):
        return obj
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value, where)
    if isinstance(obj, _SAFE_SCALARS):
        return obj
    if isinstance(obj, Mapping):
        return {to_plain(k, where): to_plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted((to_plain(v, where) for v in obj), key=repr)
    if isinstance(obj, tuple):
        return tuple(to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, list):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    rank_zero_warn(
        f"lightning-frozen: {where} holds a `{type(obj).__name__}`, which a `weights_only=True` checkpoint cannot"
        " store; its repr is saved instead. Save plain values (numbers, strings, lists, dicts) there."
    )
    return repr(obj)


# ---------------------------------------------------------------------------------------------- file


def write_atomic(checkpoint: dict, path: PathLike) -> None:
    """Write ``checkpoint`` to ``path`` so a crash at any moment leaves either the old file or the new one.

    The bytes go to a temporary file in the same folder, are flushed and fsynced, then renamed over ``path``.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointFormatError(
            f"{path} is a directory (a stock DeepSpeed checkpoint?); lightning-frozen writes one file. Choose a file"
            " path such as `last.ckpt`, or remove the directory."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_checkpoint(path: PathLike) -> dict[str, Any]:
    """Open a lightning-frozen checkpoint with ``weights_only=True`` and check its layout.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointFormatError: a directory (stock DeepSpeed), a truncated or corrupt file, a file with pickled
            objects, or a checkpoint of another layout; the message names the file and the fix.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    if path.is_dir():
        raise CheckpointFormatError(
            f"{path} is a directory: a checkpoint written by Lightning's stock DeepSpeedStrategy. Convert it with"
            f" `lightning-frozen convert {path} <out.ckpt>` (or `lightning_frozen.convert_deepspeed_checkpoint`)."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointFormatError(
            f"{path} holds pickled Python objects that are not loaded for safety (`weights_only=True`): {error}."
            " Only load checkpoints you trust; a lightning-frozen checkpoint never needs this."
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        raise CheckpointFormatError(
            f"{path} is not a readable checkpoint (truncated or corrupt? {type(error).__name__}: {error})."
        ) from None
    validate_checkpoint(checkpoint, path)
    return checkpoint


def validate_checkpoint(checkpoint: Any, path: PathLike) -> None:
    """Raise :class:`CheckpointFormatError` unless ``checkpoint`` has this package's layout."""
    if not isinstance(checkpoint, dict):
        raise CheckpointFormatError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    marker = checkpoint.get(FORMAT_KEY)
    if not isinstance(marker, dict):
        hint = (
            " It looks like a plain Lightning checkpoint (full weights): load it with"
            " `LightningModule.load_from_checkpoint`."
            if "state_dict" in checkpoint
            else ""
        )
        raise CheckpointFormatError(f"{path} is not a lightning-frozen checkpoint (no `{FORMAT_KEY}` key).{hint}")
    version = marker.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{path} has lightning-frozen format version {version}; this version reads {FORMAT_VERSION}."
            " Upgrade lightning-frozen to read it."
        )
    for key in ("state_dict", "frozen_base"):
        if not isinstance(checkpoint.get(key), dict):
            raise CheckpointFormatError(f"{path} is missing its `{key}` entry; the file is damaged.")


# ---------------------------------------------------------------------------------------------- content


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that ``state_dict()`` would save, by name."""
    buffers: dict[str, torch.Tensor] = {}
    for prefix, submodule in module.named_modules():
        for name, buffer in submodule.named_buffers(recurse=False):
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                buffers[f"{prefix}.{name}" if prefix else name] = buffer
    return buffers


def frozen_base_entry(
    module: nn.Module, fingerprint: dict[str, Any], explicit_reference: Optional[str], trainable_names: list[str]
) -> dict[str, Any]:
    """The ``frozen_base`` entry: reference, fingerprint and, for a PEFT model, what export needs."""
    entry: dict[str, Any] = {
        "reference": base.find_base_reference(module, explicit_reference),
        "fingerprint": fingerprint,
    }
    peft = base.find_peft_model(module)
    if peft is not None:
        from lightning_frozen.peft_export import peft_entry

        entry["peft"] = peft_entry(peft[0], peft[1], trainable_names)
    return entry


def check_keys(
    state_dict: Mapping[str, Any], trainable: Mapping[str, Any], buffers: Mapping[str, Any], source: str
) -> None:
    """Raise :class:`CheckpointKeysError` naming trainable params the checkpoint lacks and keys the module lacks."""
    known = set(trainable) | set(buffers)
    missing = sorted(set(trainable) - set(state_dict))
    unexpected = sorted(set(state_dict) - known)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing trainable parameters {_shorten(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {_shorten(unexpected)} (not trainable parameters or buffers of the module)")
    raise CheckpointKeysError(
        f"{source} does not match the module: {'; '.join(parts)}. Check that the module is built and frozen the same"
        " way as when the checkpoint was saved (same adapter config and trainable parameters), or pass"
        " `strict=False` to load the keys that do match."
    )


def _shorten(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------- loading for use


def _named_frozen(
    module: nn.Module, recorded: Mapping[str, Any], trained: Mapping[str, Any] = {}
) -> list[tuple[str, torch.Tensor]]:
    """The module's tensors that the recorded fingerprint covers (by name), plus any other frozen ones, less those
    the checkpoint holds trained values for (a finetuning callback unfroze them; they are loaded, not verified)."""
    params = dict(module.named_parameters())
    names = set(recorded.get("tensors", {})) | {n for n, p in params.items() if not p.requires_grad}
    return [(n, params[n]) for n in sorted(names - set(trained)) if n in params]


def load_into(module: nn.Module, checkpoint: Mapping[str, Any], source: str, strict: bool, verify: bool) -> None:
    """Verify the frozen base of ``module`` and copy the checkpoint's trainable state into it (no DeepSpeed)."""
    frozen_base = checkpoint["frozen_base"]
    state_dict = checkpoint["state_dict"]
    if verify:
        recorded = frozen_base.get("fingerprint") or {}
        base.verify_base(recorded, _named_frozen(module, recorded, state_dict), frozen_base.get("reference"), source)
    params = dict(module.named_parameters())
    buffers = persistent_buffers(module)
    frozen_names = set((frozen_base.get("fingerprint") or {}).get("tensors", {}))
    trainable = {n: p for n, p in params.items() if n not in frozen_names and (p.requires_grad or n in state_dict)}
    if strict:
        check_keys(state_dict, trainable, buffers, source)
    with torch.no_grad():
        for name, value in state_dict.items():
            target = params.get(name, buffers.get(name))
            if target is None:
                continue
            if tuple(target.shape) != tuple(value.shape):
                raise CheckpointKeysError(
                    f"{source}: `{name}` has shape {tuple(value.shape)} in the checkpoint but {tuple(target.shape)}"
                    " in the module. Build the module with the same configuration as when it was trained."
                )
            target.copy_(value.to(device=target.device, dtype=target.dtype))


def load_adapter(module: ModuleT, checkpoint_path: PathLike, strict: bool = True, verify_base: bool = True) -> ModuleT:
    """Load a lightning-frozen checkpoint's trainable state into ``module``, which already holds its frozen base.

    Needs no DeepSpeed and no process group. The frozen base is verified against the checkpoint's fingerprint
    first. Returns ``module``.

    Raises:
        FileNotFoundError, CheckpointFormatError: the file is missing or not a lightning-frozen checkpoint.
        FrozenBaseMismatchError: ``module``'s frozen parameters are not the base the checkpoint was trained on.
        CheckpointKeysError: trainable parameters missing from the checkpoint, or keys the module lacks.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_adapter expects a torch.nn.Module, got {type(module).__name__}.")
    checkpoint = read_checkpoint(checkpoint_path)
    load_into(module, checkpoint, str(checkpoint_path), strict, verify_base)
    return module


def load_from_checkpoint(cls: type[ModuleT], checkpoint_path: PathLike, **kwargs: Any) -> ModuleT:
    """Like ``LightningModule.load_from_checkpoint`` for adapter checkpoints.

    Builds ``cls(**hyper_parameters, **kwargs)`` (the module builds its own frozen base in ``__init__``), verifies
    the base, loads the trainable state, calls ``on_load_checkpoint`` and returns the module in eval mode.
    Keyword arguments ``strict`` and ``verify_base`` are taken by this function, the rest go to ``cls``.
    """
    strict = bool(kwargs.pop("strict", True))
    verify = bool(kwargs.pop("verify_base", True))
    checkpoint = read_checkpoint(checkpoint_path)
    # LightningCLI and Lightning add private entries (`_class_path`, `_instantiator`) that are no init arguments
    hyper_parameters = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if not k.startswith("_")}
    module = cls(**{**hyper_parameters, **kwargs})
    load_into(module, checkpoint, str(checkpoint_path), strict, verify)
    if hasattr(module, "on_load_checkpoint"):
        module.on_load_checkpoint(checkpoint)
    return module.eval()


def checkpoint_bytes(checkpoint: dict) -> int:
    """Size the checkpoint would have on disk, without writing it."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.tell()
