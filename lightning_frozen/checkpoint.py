"""The adapter checkpoint file: build, write atomically, read, validate, and load for use without DeepSpeed.

One file, whatever the number of ranks that wrote it, that ``torch.load(path, weights_only=True)`` opens:

- Lightning's usual keys (``epoch``, ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``,
  ``hyper_parameters``, ...);
- ``state_dict``: the trainable parameters (fp32 master values) and persistent buffers, never a frozen weight;
- ``optimizer_states``: ``[{"state": {param name: {key: whole tensor or scalar}}, "param_groups": [...]}]``,
  keyed by parameter name so that any world size can resume; the fp32 weights are not stored twice;
- ``frozen_base``: ``reference``, ``fingerprint`` and, for PEFT models, the adapter config and key mapping;
- ``lightning_frozen``: the format version.

Writes go to a temporary file renamed over the checkpoint, so a process killed at any moment leaves whole files
under checkpoint names; the temporary file it may leave is removed by a later write into the same folder. Paths may
also be fsspec URLs (``s3://``, ``gs://``, ``memory://``), written and read through fsspec.
Reads never unpickle anything but tensors and containers (``weights_only=True``).
"""

from __future__ import annotations

import enum
import hashlib
import io
import logging
import os
import pickle
import re
import secrets
import socket
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Optional, TypeVar, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_frozen import frozen_base as base
from lightning_frozen.errors import (
    CheckpointFormatError,
    CheckpointKeysError,
    CheckpointNotFoundError,
    InvalidArgumentTypeError,
    UnsupportedConfigurationError,
    format_names,
)

FORMAT_KEY = "lightning_frozen"
FORMAT_VERSION = 1
OPTIMIZER_LAYOUT = "by_name"

PathLike = Union[str, os.PathLike]
ModuleT = TypeVar("ModuleT", bound=nn.Module)
T = TypeVar("T")

log = logging.getLogger(__name__)

# `.<name>.lf-<pid space>-<pid>-<random>.tmp`: who wrote a temp file, so a later save can tell a dead writer's.
# (8 hex digits: a host-name tag of lightning-frozen 0.1, removed by age only)
_TEMP_FILE = re.compile(r"^\..+\.lf-(?P<space>[0-9a-f]{16}|[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]+\.tmp$")
# A temp file nobody has written to for this long is stale whoever wrote it (another machine or container, or a
# reused pid).
STALE_TEMP_SECONDS = 3600.0

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
        f"`{function}`: `{parameter}` must be a file system path or URL (str or os.PathLike), got {value!r}."
    )


def checked_path(value: Any, parameter: str, function: str) -> Path:
    """``value`` as a local ``Path``; a ``TypeError`` when it is no path at all, and a clear refusal for a URL."""
    if not (isinstance(value, (str, os.PathLike)) and str(value)):
        raise InvalidArgumentTypeError(
            f"`{function}`: `{parameter}` must be a file system path (str or os.PathLike), got {value!r}."
        )
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
    if location.is_dir():
        raise CheckpointFormatError(
            f"{location} is a directory (a stock DeepSpeed checkpoint?); lightning-frozen writes one file. Choose a"
            " file path such as `last.ckpt`, or remove the directory."
        )
    write_file_atomic(location, lambda handle: torch.save(checkpoint, handle))


def write_url(url: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(handle)`` on a temporary object next to ``url`` through fsspec, then move it to ``url``.

    An object store publishes an object only once its upload is complete, so readers never see half a checkpoint; a
    writer killed mid-upload may leave its ``.<name>.lf-<random>.tmp`` object behind (remote folders are not swept).
    """
    from lightning.fabric.utilities.cloud_io import get_filesystem

    fs = get_filesystem(url)
    if fs.isdir(url):
        raise CheckpointFormatError(
            f"{url} is a directory (a stock DeepSpeed checkpoint?); lightning-frozen writes one file. Choose a file"
            " URL such as `.../last.ckpt`, or remove the directory."
        )
    parent, _, name = url.rstrip("/").rpartition("/")
    fs.makedirs(parent, exist_ok=True)
    tmp = f"{parent}/.{name}.lf-{secrets.token_hex(8)}.tmp"
    try:
        with fs.open(tmp, "wb") as handle:
            write(handle)
        fs.mv(tmp, url)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise


def write_file_atomic(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(handle)`` on a new temporary file next to ``path``, fsync it, then rename it over ``path``.

    The temporary file is ``.<name>.lf-<pid space>-<pid>-<random>.tmp`` in the same folder, created exclusively (never
    through an existing file or link). A process killed mid-write (SIGKILL, out of memory, power loss) leaves it
    behind: every write first removes such files in its folder when they are stale (see
    :func:`remove_stale_temp_files`), so they do not pile up across restarts.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path.parent)
    tmp = path.parent / f".{path.name}.lf-{pid_space_tag()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    # O_EXCL: a new file or an error, never through a planted file or link; 0o666 so the umask sets the mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Delete the temp files :func:`write_file_atomic` left in ``folder`` when its process died; return them.

    A temp file is stale when it was written in this pid space (see :func:`pid_space_tag`) by a process that no
    longer runs, or when nothing has written to it for ``STALE_TEMP_SECONDS`` (its writer ran on another machine or
    in another container sharing the folder, or its pid was reused). A live writer's file, here or elsewhere, is left
    alone, as is every file not named like ours.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    space, now = pid_space_tag(), time.time()
    for entry in entries:
        match = _TEMP_FILE.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            idle = now - entry.stat(follow_symlinks=False).st_mtime
            dead = match["space"] == space and not _process_runs(int(match["pid"]))
            if dead or idle > STALE_TEMP_SECONDS:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except FileNotFoundError:
            continue  # another process removed or renamed it meanwhile
    if removed:
        log.warning(
            "lightning-frozen: removed %d temp file(s) left in %s by an interrupted checkpoint write: %s",
            len(removed),
            folder,
            ", ".join(path.name for path in removed),
        )
    return removed


def pid_space_tag() -> str:
    """A tag shared by exactly the processes whose pids this process can check: same kernel boot, same pid namespace.

    A host name is not enough: containers on one machine (or on several) often share one, while each has its own pid
    namespace, where another container's live writer looks dead. Without ``/proc`` (not Linux) the host name is used.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        space = f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        space = socket.gethostname()
    return hashlib.sha256(space.encode()).hexdigest()[:16]


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it runs, under another user
    return True


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
    """Open a lightning-frozen checkpoint with ``weights_only=True`` and check its layout; nothing in it is executed.

    ``path`` is a local path or an fsspec URL (``s3://...``, ``memory://...``).

    Raises:
        TypeError: ``path`` is not a path.
        FileNotFoundError: nothing at ``path``.
        CheckpointFormatError: a directory (stock DeepSpeed), an unreadable, truncated or corrupt file, a file with
            pickled objects, or a checkpoint of another layout; the message names the file and the fix.
    """
    location = checked_location(path, "path", "read_checkpoint")
    source = _open_for_reading(location)
    try:
        checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    except OSError as error:
        raise CheckpointFormatError(f"{location} cannot be read ({type(error).__name__}: {error}).") from None
    except Exception as error:  # torch.load raises whatever its parsers meet in a damaged or foreign file
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
    validate_checkpoint(checkpoint, location)
    return checkpoint


def _open_for_reading(location: Union[Path, str]) -> Union[Path, io.BytesIO]:
    """The local file, or a URL's bytes; refuses what is missing and directories (stock DeepSpeed checkpoints)."""
    if isinstance(location, str):
        from lightning.fabric.utilities.cloud_io import get_filesystem

        fs = get_filesystem(location)
        _refuse_missing_or_directory(location, fs.exists(location), fs.isdir(location))
        return io.BytesIO(fs.cat_file(location))
    _refuse_missing_or_directory(location, location.exists(), location.is_dir())
    return location


def _refuse_missing_or_directory(location: Union[Path, str], exists: bool, is_dir: bool) -> None:
    if not exists:
        raise CheckpointNotFoundError(f"No checkpoint at {location}.")
    if is_dir:
        raise CheckpointFormatError(
            f"{location} is a directory: a checkpoint written by Lightning's stock DeepSpeedStrategy. Convert it with"
            f" `lightning-frozen convert {location} <out.ckpt>` (or `lightning_frozen.convert_deepspeed_checkpoint`)."
        )


def _rewound(source: Union[Path, io.BytesIO], read: Callable[[Any], T]) -> T:
    if isinstance(source, io.BytesIO):
        source.seek(0)
    return read(source)


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


def validate_checkpoint(checkpoint: Any, path: PathLike) -> None:
    """Raise :class:`CheckpointFormatError` unless ``checkpoint`` has this package's layout."""
    if not isinstance(checkpoint, dict):
        raise CheckpointFormatError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    marker = checkpoint.get(FORMAT_KEY)
    if not isinstance(marker, dict):
        hint = (
            " It looks like a plain Lightning checkpoint (full weights): load it with"
            " `YourModule.load_from_checkpoint`, and to train on from those weights, fit that module without"
            " `ckpt_path`."
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

        entry["peft"] = peft_entry(peft[0], peft[1], trainable_names, list(persistent_buffers(module)))
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
        parts.append(f"missing trainable parameters {format_names(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {format_names(unexpected)} (not trainable parameters or buffers of the module)")
    raise CheckpointKeysError(
        f"{source} does not match the module: {'; '.join(parts)}. Check that the module is built and frozen the same"
        " way as when the checkpoint was saved (same adapter config and trainable parameters), or pass"
        " `strict=False` to load the keys that do match."
    )


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
    targets = {name: params.get(name, buffers.get(name)) for name in state_dict}
    pairs = [(target, state_dict[name]) for name, target in targets.items() if target is not None]
    for name, target in targets.items():
        # every shape is checked before the first copy, so a refused checkpoint leaves the module as it was
        if target is not None and tuple(target.shape) != tuple(state_dict[name].shape):
            raise CheckpointKeysError(
                f"{source}: `{name}` has shape {tuple(state_dict[name].shape)} in the checkpoint but"
                f" {tuple(target.shape)} in the module. Build the module with the same configuration as when it"
                " was trained."
            )
    with torch.no_grad():
        for target, value in pairs:
            target.copy_(value.to(device=target.device, dtype=target.dtype))


def load_adapter(module: ModuleT, checkpoint_path: PathLike, strict: bool = True, verify_base: bool = True) -> ModuleT:
    """Load a lightning-frozen checkpoint's trainable state into ``module``, which already holds its frozen base.

    Needs no DeepSpeed and no process group. The frozen base is verified against the checkpoint's fingerprint
    first. Returns ``module``.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module`` or ``checkpoint_path`` is not a path.
        FileNotFoundError, CheckpointFormatError: the file is missing or not a lightning-frozen checkpoint.
        FrozenBaseMismatchError: ``module``'s frozen parameters are not the base the checkpoint was trained on.
        CheckpointKeysError: trainable parameters missing from the checkpoint, or keys the module lacks; the module
            is left unchanged.
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgumentTypeError(
            f"`load_adapter`: `module` must be a torch.nn.Module, got {type(module).__name__}."
        )
    checkpoint = read_checkpoint(checked_location(checkpoint_path, "checkpoint_path", "load_adapter"))
    load_into(module, checkpoint, str(checkpoint_path), strict, verify_base)
    return module


def load_from_checkpoint(cls: type[ModuleT], checkpoint_path: PathLike, **kwargs: Any) -> ModuleT:
    """Like ``LightningModule.load_from_checkpoint`` for adapter checkpoints.

    Builds ``cls(**hyper_parameters, **kwargs)`` and calls its ``configure_model`` as Lightning does (the module may
    build its frozen base in either), verifies the base, loads the trainable state, calls ``on_load_checkpoint`` and
    returns the module in eval mode.
    Keyword arguments ``strict`` and ``verify_base`` are taken by this function, the rest go to ``cls``.

    Raises:
        TypeError: ``cls`` is not a ``torch.nn.Module`` class (an instance, say) or ``checkpoint_path`` is not a path.
        FileNotFoundError, CheckpointFormatError, FrozenBaseMismatchError, CheckpointKeysError: as
            :func:`load_adapter`.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise InvalidArgumentTypeError(
            f"`load_from_checkpoint`: `cls` must be the module class (e.g. `MyModule`), got"
            f" {f'an instance of `{type(cls).__name__}`' if not isinstance(cls, type) else repr(cls)}. To load into a"
            " module you already built, use `lightning_frozen.load_adapter(module, checkpoint_path)`."
        )
    strict = bool(kwargs.pop("strict", True))
    verify = bool(kwargs.pop("verify_base", True))
    checkpoint = read_checkpoint(checked_location(checkpoint_path, "checkpoint_path", "load_from_checkpoint"))
    # LightningCLI and Lightning add private entries (`_class_path`, `_instantiator`) that are no init arguments
    hyper_parameters = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if not k.startswith("_")}
    try:
        module = cls(**{**hyper_parameters, **kwargs})
    except TypeError as error:
        raise InvalidArgumentTypeError(
            f"`load_from_checkpoint`: `{cls.__name__}` cannot be built from the hyper-parameters saved in"
            f" {checkpoint_path} ({error}). Was it saved from another class? Pass the class it was trained with, or"
            " override the offending arguments as keyword arguments."
        ) from error
    if callable(getattr(module, "configure_model", None)):
        module.configure_model()  # as Lightning's `load_from_checkpoint` does: the base may be built there
    load_into(module, checkpoint, str(checkpoint_path), strict, verify)
    if hasattr(module, "on_load_checkpoint"):
        module.on_load_checkpoint(checkpoint)
    return module.eval()
