"""The adapter checkpoint file: writing it atomically, reading and validating it.

The layout (every key, how the dict is built and read) is ``layout.py``'s. Writes are atomic (see
``atomic_files.py``); paths may also be fsspec URLs (``s3://``, ``gs://``, ``memory://``). Reads never unpickle
anything but tensors and containers (``weights_only=True``). Building the trainable state lives in
``trainable_state.py``, loading it without DeepSpeed in ``loading.py``.
"""

import enum
import functools
import io
import os
import pickle
import zipfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import IO, Any, Optional, TypeVar, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_frozen import lightning_seam
from lightning_frozen.capabilities import EARLY_CKPT_CHECK, available
from lightning_frozen.checkpoint.atomic_files import write_file_atomic, write_url
from lightning_frozen.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    InvalidArgumentTypeError,
    UnsupportedConfigurationError,
    format_names,
)
from lightning_frozen.format import layout
from lightning_frozen.zero import torch_file

PathLike = Union[str, os.PathLike]
T = TypeVar("T")

# what stock `DeepSpeedStrategy.load_checkpoint` says first where a path holds no checkpoint: callers match it
NOT_A_CHECKPOINT = "The provided path is not a valid DeepSpeed checkpoint"

_JSON_SCALARS = (str, int, float, bool, type(None))
_SAFE_SCALARS = (*_JSON_SCALARS, torch.dtype, torch.device, torch.Size)


# ---------------------------------------------------------------------------------------------- plain types


def to_plain(obj: Any, where: str = "checkpoint", json_types: bool = False) -> Any:
    """Convert ``obj`` to what ``torch.load(weights_only=True)`` accepts: tensors, containers and plain scalars.

    Dict subclasses become dicts, enums their values, sets sorted lists, paths strings. Anything else is
    replaced by its ``repr`` with a warning naming where it sat, so no pickled class ends up in the file.
    With ``json_types`` (a PEFT config, also written as JSON) the result holds JSON types only: keys become strings,
    tuples lists, and anything else its ``str``.
    """
    if torch.is_tensor(obj) and not json_types:
        return obj
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value, where, json_types)
    if isinstance(obj, _JSON_SCALARS if json_types else _SAFE_SCALARS):
        return obj
    if isinstance(obj, Mapping):
        return {
            (str(k) if json_types else to_plain(k, where)): to_plain(v, f"{where}[{k!r}]", json_types)
            for k, v in obj.items()
        }
    if isinstance(obj, (set, frozenset)):
        return sorted((to_plain(v, where, json_types) for v in obj), key=None if json_types else repr)
    if isinstance(obj, tuple) and not json_types:
        return tuple(to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(obj, (list, tuple)):
        return [to_plain(v, f"{where}[{i}]", json_types) for i, v in enumerate(obj)]
    if json_types:
        return str(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    rank_zero_warn(
        f"lightning-frozen: {where} holds a `{type(obj).__name__}`, which a `weights_only=True` checkpoint cannot"
        " store; its repr is saved instead. Save plain values (numbers, strings, lists, dicts) there."
    )
    return repr(obj)


# ---------------------------------------------------------------------------------------------- file


def is_url(value: Any) -> bool:
    """Whether ``value`` names a file through an fsspec protocol (``s3://``, ``gs://``, ``memory://``...)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    return isinstance(text, str) and "://" in text


def checked_location(value: Any, parameter: str, function: str) -> Union[Path, str]:
    """``value`` as a local ``Path``, or as the URL string it is; a ``TypeError`` naming ``function``'s ``parameter``
    when it is neither."""
    if isinstance(value, (str, os.PathLike)) and str(value):
        return os.fspath(value) if is_url(value) else Path(value)
    raise InvalidArgumentTypeError(
        f"`{function}`: `{parameter}` must be a file system path (str or os.PathLike), got {value!r}."
    )


def checked_path(value: Any, parameter: str, function: str) -> Path:
    """``value`` as a local ``Path``; a ``TypeError`` when it is no path at all, and a clear refusal for a URL."""
    location = checked_location(value, parameter, function)
    if isinstance(location, str):
        raise UnsupportedConfigurationError(
            f"`{function}`: `{parameter}` must be a local path; {location} is a URL. Copy it to a local folder first"
            " (e.g. with `fsspec.get_filesystem_class(protocol)().get(url, local_path)`)."
        )
    return location


def write_atomic(checkpoint: dict, path: PathLike) -> None:
    """Write ``checkpoint`` to ``path`` so a crash at any moment leaves either the old file or the new one.

    See :func:`write_file_atomic`; a directory at ``path`` (a stock DeepSpeed checkpoint) is refused, not replaced.
    A URL (``s3://...``) is written through fsspec, see :func:`write_url`.
    """
    location = checked_location(path, "path", "write_atomic")
    if isinstance(location, str):
        write_url(location, lambda handle: torch.save(checkpoint, handle))
        return
    write_file_atomic(_file_target(location), lambda handle: torch.save(checkpoint, handle))


def write_in_two_passes(
    checkpoint: dict, path: PathLike, later: Collection[torch.Tensor], fill: Callable[[torch_file.Put], None]
) -> None:
    """:func:`save` to a local ``path``, where the tensors of ``later`` (placeholders on the meta device) are written
    as ``fill(put)`` gives their values, one at a time (``zero/torch_file.py``): the same file, atomically."""
    plain = to_plain(checkpoint)
    location = _file_target(checked_path(path, "path", "write_in_two_passes"))
    write_file_atomic(location, lambda handle: torch_file.save_in_two_passes(plain, handle, later, fill))


def _file_target(location: Path) -> Path:
    """``location``, refused where it is a directory (a stock DeepSpeed checkpoint): a save never replaces one."""
    if location.is_dir():
        stock = " (a stock DeepSpeed checkpoint)" if deepspeed_shard_folder(location) is not None else ""
        raise CheckpointFormatError(
            f"{location} is a directory{stock}; lightning-frozen writes one file. Choose a file path such as"
            " `last.ckpt`, or remove the directory."
        )
    return location


def user_checkpoint_io(checkpoint_io: CheckpointIO, storage_options: Any = None) -> Optional[CheckpointIO]:
    """The Trainer's ``CheckpointIO`` plugin when the user chose one (cloud storage, async saves), which then writes
    and reads the file; None for Lightning's default, which this package replaces with its own atomic write.

    Raises:
        TypeError: ``storage_options`` given without a plugin to take them.
    """
    if type(checkpoint_io) is not TorchCheckpointIO:
        return checkpoint_io
    if storage_options is not None:
        raise InvalidArgumentTypeError(
            "`Trainer.save_checkpoint(..., storage_options=...)` needs a `CheckpointIO` plugin that takes them"
            " (`Trainer(plugins=[...])`); lightning-frozen writes the file itself otherwise."
        )
    return None


def save(checkpoint: dict, path: PathLike, checkpoint_io: Optional[CheckpointIO], storage_options: Any = None) -> None:
    """Write ``checkpoint`` in plain types (:func:`to_plain`), with :func:`write_atomic` or ``checkpoint_io``."""
    plain = to_plain(checkpoint)
    if checkpoint_io is None:
        write_atomic(plain, path)
    else:
        checkpoint_io.save_checkpoint(plain, path, storage_options=storage_options)


def load(path: PathLike, checkpoint_io: Optional[CheckpointIO]) -> dict[str, Any]:
    """:func:`read_checkpoint`, or the same layout checks on what ``checkpoint_io`` reads."""
    if checkpoint_io is None:
        return read_checkpoint(path)
    loaded = checkpoint_io.load_checkpoint(path, weights_only=True)
    layout.validate(loaded, path)
    return loaded


def read_checkpoint(path: PathLike) -> dict[str, Any]:
    """Open a lightning-frozen checkpoint with ``weights_only=True`` and check its layout; nothing in it is executed.

    ``path`` is a local path or an fsspec URL (``s3://...``, ``memory://...``). A local file is memory-mapped: the
    trainable state (the ``state_dict`` and each optimizer entry's per-param ``state``) stays a view of the file, read
    only where a reader copies from it (a resuming rank, its own part of each tensor), and unmapped once nothing
    holds it; every other tensor is copied into memory.

    Raises:
        TypeError: ``path`` is not a path.
        FileNotFoundError: nothing at ``path``.
        CheckpointFormatError: a directory (stock DeepSpeed), an unreadable, truncated or corrupt file, a file with
            pickled objects, or a checkpoint of another layout; the message names the file and the fix.
    """
    location = checked_location(path, "path", "read_checkpoint")
    source = _open_for_reading(location)
    try:
        mapped = isinstance(source, Path)
        checkpoint = torch.load(source, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as error:  # torch.load raises whatever its parsers meet in a damaged or foreign file
        if _rewound(source, _is_truncated):
            raise CheckpointFormatError(
                f"{location} is truncated: it ends before the end of its zip archive, as an interrupted copy,"
                " download or save leaves a file. Copy it again, or resume from an earlier checkpoint."
            ) from None
        if isinstance(error, OSError):
            raise CheckpointFormatError(f"{location} cannot be read ({type(error).__name__}: {error}).") from None
        if isinstance(error, pickle.UnpicklingError) and _rewound(source, zipfile.is_zipfile):
            found = _rewound(source, unsafe_globals)
            named = f" ({', '.join(found[:5])})" if found else ""
            raise CheckpointFormatError(
                f"{location} holds pickled Python objects{named} that are not loaded for safety"
                " (`weights_only=True`); nothing in the file was executed. A lightning-frozen checkpoint never holds"
                " them: the file was written by something else or tampered with."
            ) from None
        raise CheckpointFormatError(
            f"{location} is not a readable checkpoint (truncated or corrupt? {load_error(error)})."
        ) from None
    layout.validate(checkpoint, location)
    return _all_but_trainable_copied(checkpoint) if mapped else checkpoint


def _all_but_trainable_copied(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A memory-mapped checkpoint with every tensor copied out of the file but the trainable state's: what keeps a
    tensor after a resume (a callback's state, a scheduler's, a loop's) does not keep the file mapped, nor the pages
    of it that the resume read."""

    copied = functools.partial(apply_to_collection, dtype=torch.Tensor, function=torch.Tensor.clone)

    def entry(value: Any) -> Any:
        if not isinstance(value, dict):
            return copied(value)
        return {key: state if key == layout.OPTIMIZER_STATE else copied(state) for key, state in value.items()}

    return {
        key: value
        if key == layout.STATE_DICT
        else [entry(e) for e in value]
        if key == layout.OPTIMIZER_STATES and isinstance(value, list)
        else copied(value)
        for key, value in checkpoint.items()
    }


def _open_for_reading(location: Union[Path, str]) -> Union[Path, io.BytesIO]:
    """The local file, or a URL's bytes; refuses what is missing and directories (see :func:`require_file`)."""
    require_file(location)
    if isinstance(location, str):
        return io.BytesIO(get_filesystem(location).cat_file(location))
    return location


def require_file(location: Union[Path, str], given_as: str = "") -> None:
    """Refuse a ``location`` (a local ``Path`` or a URL) that :func:`read_checkpoint` cannot open as a file;
    ``given_as`` says where the path came from, for the message.

    Raises:
        CheckpointNotFoundError: nothing at ``location``, a directory that holds no checkpoint, or a path inside a stock
            DeepSpeed checkpoint (a ``FileNotFoundError``, in stock's words, saying to convert that checkpoint).
        CheckpointFormatError: a stock DeepSpeed checkpoint directory; the message says to convert it.
    """
    if isinstance(location, str):
        fs = get_filesystem(location)
        exists, is_dir = fs.exists(location), fs.isdir(location)
    else:
        exists, is_dir = location.exists(), location.is_dir()
    stock = _stock_checkpoint_holding(location) if isinstance(location, Path) else None
    inside = (
        f" It lies inside {stock}, a checkpoint written by Lightning's stock DeepSpeedStrategy: convert that parent"
        f" directory instead, with `lightning-frozen convert {stock} <out.ckpt>`."
        if stock is not None and stock != location
        else ""
    )
    if not exists:
        relative = (
            "" if isinstance(location, str) or location.is_absolute() else f" (relative paths start at {Path.cwd()})"
        )
        raise CheckpointNotFoundError(f"No checkpoint at {location}{given_as}: check the path{relative}.{inside}")
    if inside:
        raise CheckpointNotFoundError(
            f"{NOT_A_CHECKPOINT}: {location} is not a lightning-frozen checkpoint file{given_as}.{inside}"
        )
    if not is_dir:
        return
    if stock is not None:
        raise CheckpointFormatError(
            f"{location} is a directory: a checkpoint written by Lightning's stock DeepSpeedStrategy. Convert it with"
            f" `lightning-frozen convert {location} <out.ckpt>` (or `lightning_frozen.convert_deepspeed_checkpoint`)."
        )
    inside = sorted(p.name for p in location.glob("*.ckpt")) if isinstance(location, Path) else []
    holds = f" It holds {format_names(inside)}." if inside else ""
    raise CheckpointNotFoundError(
        f"{NOT_A_CHECKPOINT}: {location} is a directory, not a checkpoint file{given_as}. Pass the path of the"
        " `.ckpt` file itself (a ModelCheckpoint writes them in its `dirpath`, by default"
        f" `<default_root_dir>/lightning_logs/version_<n>/checkpoints/`).{holds}"
    )


def _stock_checkpoint_holding(location: Path) -> Optional[Path]:
    """The stock DeepSpeed checkpoint directory that ``location`` is, or lies in (its tag folder, a file or a missing
    name there), as Lightning's own check of a DeepSpeed path looks at the parent folders; None when there is none."""
    for folder in (location, location.parent, location.parent.parent):
        if folder.is_dir() and deepspeed_shard_folder(folder) is not None:
            return folder
    return None


def deepspeed_shard_folder(directory: Path) -> Optional[Path]:
    """The folder of a stock DeepSpeed checkpoint ``directory`` that holds its ``*_model_states.pt`` shard files: the
    tag its ``latest`` file names, else ``checkpoint`` (Lightning's tag); None when ``directory`` is no such checkpoint.
    """
    latest = directory / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "checkpoint"
    folder = directory / tag
    return folder if folder.is_dir() and any(folder.glob("*_model_states.pt")) else None


def require_restore_path(trainer: pl.Trainer, checkpoint_io: CheckpointIO) -> None:
    """Refuse, before anything is built, a ``ckpt_path`` of the running Trainer where :func:`read_checkpoint` would
    find no file (:func:`require_file`); a user's ``checkpoint_io`` plugin, or ``EARLY_CKPT_CHECK`` off, skips it."""
    if user_checkpoint_io(checkpoint_io) is not None or not available(EARLY_CKPT_CHECK):
        return
    path = lightning_seam.resolved_ckpt_path(trainer)
    if path:
        given_as = f" (the `ckpt_path` of `{trainer.state.fn.value}`)" if trainer.state.fn else ""
        require_file(checked_location(path, "ckpt_path", "Trainer"), given_as)


def _rewound(source: Union[Path, io.BytesIO], read: Callable[[Any], T]) -> T:
    if isinstance(source, io.BytesIO):
        source.seek(0)
    return read(source)


def _is_truncated(source: Union[Path, IO[bytes]]) -> bool:
    """Whether ``source`` is a zip archive (what ``torch.save`` writes) whose end, the central directory, is missing: a
    file cut short."""
    try:
        if isinstance(source, Path):
            with source.open("rb") as handle:
                head = handle.read(4)
        else:
            head = source.read(4)
            source.seek(0)
        return head == b"PK\x03\x04" and not zipfile.is_zipfile(source)
    except OSError:  # unreadable: said as such by the caller
        return False


def load_error(error: Exception) -> str:
    """``torch.load``'s error in one line: its weights-only refusal runs to many lines of advice, named by type only."""
    if isinstance(error, pickle.UnpicklingError):
        return type(error).__name__
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def unsafe_globals(path: Union[Path, IO[bytes]]) -> list[str]:
    """The Python objects a ``torch.save`` file would unpickle beyond tensors and containers (statically read)."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a readable torch.save archive at all
        return []
