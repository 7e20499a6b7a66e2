"""Writing a file so that a crash at any moment leaves the old file or the new one, locally or through fsspec.

Writes go to a temporary file renamed over the target, so a process killed at any moment leaves whole files under
their names; the temporary file it may leave is removed by a later write into the same folder. On an object store
(``s3://``, ``gs://``, ``memory://``) an object is published only once its upload is complete.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from lightning_frozen import process
from lightning_frozen.errors import CheckpointFormatError, OutputDirectoryError

log = logging.getLogger(__name__)

# `.<name>.lf-<pid space>-<pid>-<random>.tmp` (process.owned_name): who wrote a temp file or folder, so that a later
# write into the same folder can tell a dead writer's
_TEMP_FILE = process.owned_names(r"\..+\.lf", r"\.tmp")
# `.<name>.lf-<pid space>-<pid>-<random>.old`: an export folder moved aside while its replacement takes its name
_MOVED_ASIDE = process.owned_names(r"\.(?P<target>.+)\.lf", r"\.old")


def write_url(url: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(handle)`` on a temporary object next to ``url`` through fsspec, then move it to ``url``.

    An object store publishes an object only once its upload is complete, so readers never see half a checkpoint; a
    writer killed mid-upload may leave its ``.<name>.lf-<random>.tmp`` object behind (remote folders are not swept).
    """
    from lightning.fabric.utilities.cloud_io import get_filesystem

    fs = get_filesystem(url)
    if fs.isdir(url):
        raise CheckpointFormatError(
            f"{url} is a directory; lightning-frozen writes one file. Choose a file"
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
    """Call ``write(handle)`` on a new temporary file next to ``path`` (open for writing and reading), fsync it, then
    rename it over ``path``; a temporary file a dead writer left is swept first (:func:`remove_stale_temp_files`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path.parent)
    tmp = _temp_path(path)
    # O_EXCL: a new file or an error, never through a planted file or link; 0o666 so the umask sets the mode. Open
    # for reading too: a write in two passes reads where the first put each tensor (zero/torch_file.py)
    fd = process.start_writing(tmp, lambda: _locked(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)))
    try:
        with process.removed_if_terminated(tmp), os.fdopen(fd, "w+b") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        process.publish(tmp, lambda: os.replace(tmp, path))
    except BaseException:
        process.abandon(tmp)
        raise
    _fsync_dir(path.parent)


@contextmanager
def folder_written_whole(destination: Path, replaceable: Callable[[str], bool]) -> Iterator[Path]:
    """Yield a new empty temporary folder beside ``destination`` to write into; when the block returns, the folder
    takes ``destination``'s place (replacing one whose entries ``replaceable`` all accepts), so a reader sees the
    previous folder or the new one, never a mix; a block that raises leaves ``destination`` as it was.

    Raises:
        OutputDirectoryError: ``destination`` is a file, or a folder holding entries an export does not write.
    """
    check_output_folder(destination, replaceable)
    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(destination.parent)
    tmp = _temp_path(destination)
    process.start_writing(tmp, tmp.mkdir)
    try:
        with _held(tmp):
            yield tmp
            for entry in os.scandir(tmp):
                _fsync_path(entry.path)
            _fsync_path(str(tmp))
            process.publish(tmp, lambda: _replace_folder(tmp, destination))
    except BaseException:
        process.abandon(tmp)
        raise
    _fsync_dir(destination.parent)


def _replace_folder(tmp: Path, destination: Path) -> None:
    if not destination.exists():
        os.replace(tmp, destination)
        return
    # the old folder steps aside under a `.old` name the next sweep puts back if need be (docs/internals.md)
    old = destination.parent / process.owned_name(f".{destination.name}.lf", ".old")
    with _held(destination):  # its lock goes with it through the renames
        os.replace(destination, old)
        try:
            os.replace(tmp, destination)
        except BaseException:
            os.replace(old, destination)
            raise
        doomed = _temp_path(destination)  # renamed whole before it is emptied: a `.old` folder is never a partial one
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _temp_path(target: Path) -> Path:
    return target.parent / process.owned_name(f".{target.name}.lf", ".tmp")


def check_output_folder(destination: Path, replaceable: Callable[[str], bool]) -> None:
    """Refuse ``destination`` as a folder :func:`folder_written_whole` would replace: a file, or a folder holding an
    entry ``replaceable`` does not accept (checked before an export reads anything, and again as it writes).

    Raises:
        OutputDirectoryError: naming the file or the entries, and what to do.
    """
    if destination.exists() and not destination.is_dir():
        raise OutputDirectoryError(f"{destination} exists and is not a directory; choose a folder to export into.")
    foreign = sorted(name for name in os.listdir(destination) if not replaceable(name)) if destination.exists() else []
    if foreign:
        raise OutputDirectoryError(
            f"{destination} holds {', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}, which an export does"
            " not write; the export replaces its folder whole. Choose a new or empty folder, or remove those entries."
        )


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Delete the temp files and folders that dead writers left in ``folder``: those ``process.dead_files`` finds and
    no live writer holds (:func:`_held`); return them. An export folder moved aside by a writer that died between its
    two renames is put back where its name is free, removed where a newer export holds the name, else kept.
    """
    superseded = []
    for aside, match in _unheld(process.dead_files(folder, _MOVED_ASIDE)):
        target = folder / match["target"]
        if target.is_dir() and not target.is_symlink():  # a newer export took its place: this is not the last copy
            superseded.append(aside)
            continue
        try:
            os.rename(aside, target)
        except OSError as error:  # a file or a link in its place, or put back by another process meanwhile
            if aside.exists():
                log.warning("lightning-frozen: kept %s, an export left aside: it cannot be put back (%s)", aside, error)
            continue
        log.warning("lightning-frozen: put back %s, left aside by an interrupted export", target)
    temp = [path for path, _ in _unheld(process.dead_files(folder, _TEMP_FILE))]
    removed = [path for path in [*temp, *superseded] if _removed(path)]
    if removed:
        log.warning(
            "lightning-frozen: removed %d temp file(s) left in %s by an interrupted checkpoint write: %s",
            len(removed),
            folder,
            ", ".join(path.name for path in removed),
        )
    return removed


def _locked(fd: int) -> int:
    """``fd`` with an exclusive flock on its file, where the filesystem has them: the sweep leaves a file or folder
    whose lock a live process holds, whatever its age, in any pid namespace; the kernel drops it when the process
    dies."""
    with suppress(OSError):  # no locks here (some network filesystems): its pid and age decide, as for another host
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


@contextmanager
def _held(path: Path) -> Iterator[None]:
    """``path`` (a folder) locked (:func:`_locked`) while the block runs."""
    fd = _locked(os.open(path, os.O_RDONLY | os.O_DIRECTORY))
    try:
        yield
    finally:
        os.close(fd)


def _unheld(found: list[tuple[Path, re.Match[str]]]) -> list[tuple[Path, re.Match[str]]]:
    """Those of ``found`` whose lock no live process holds (or that cannot be locked here)."""
    unheld = []
    for path, match in found:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # removed or renamed by another process meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live process holds it
            continue
        except OSError:  # no locks here: its pid and age decide
            pass
        finally:
            os.close(fd)
        unheld.append((path, match))
    return unheld


def _removed(path: Path) -> bool:
    with suppress(OSError):  # renamed or removed by another process meanwhile, or not this user's to remove
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        return True
    return False


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    with suppress(OSError):  # a filesystem that cannot open or sync a directory: the rename stands all the same
        _fsync_path(str(folder))
