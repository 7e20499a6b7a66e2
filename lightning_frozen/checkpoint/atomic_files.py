"""Writing a file so that a crash at any moment leaves the old file or the new one, locally or through fsspec.

Writes go to a temporary file renamed over the target, so a process killed at any moment leaves whole files under
their names; the temporary file it may leave is removed by a later write into the same folder. On an object store
(``s3://``, ``gs://``, ``memory://``) an object is published only once its upload is complete.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from lightning_frozen.errors import CheckpointFormatError, OutputDirectoryError

log = logging.getLogger(__name__)


# `.<name>.lf-<pid space>-<pid>-<random>.tmp`: who wrote a temp file, so a later save can tell a dead writer's.
# (8 hex digits: a host-name tag of lightning-frozen 0.1, removed by age only)
_TEMP_FILE = re.compile(r"^\..+\.lf-(?P<space>[0-9a-f]{16}|[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]+\.tmp$")
# A temp file nobody has written to for this long is stale whoever wrote it (another machine or container, or a
# reused pid).
STALE_TEMP_SECONDS = 3600.0
# the temp files this process is writing now, for a process that must exit at once (see preemption.py)
_BEING_WRITTEN: set[Path] = set()


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
    rename it over ``path``.

    The temporary file is ``.<name>.lf-<pid space>-<pid>-<random>.tmp`` in the same folder, created exclusively (never
    through an existing file or link). A SIGTERM or SIGHUP nobody handles removes it before it ends the process; a
    process killed mid-write (SIGKILL, out of memory, power loss) leaves it behind: every write first removes such
    files in its folder when they are stale (see :func:`remove_stale_temp_files`), so they do not pile up across
    restarts.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path.parent)
    tmp = path.parent / f".{path.name}.lf-{pid_space_tag()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    # O_EXCL: a new file or an error, never through a planted file or link; 0o666 so the umask sets the mode. Open
    # for reading too: a write in two passes reads where the first put each tensor (zero/torch_file.py)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    _BEING_WRITTEN.add(tmp)
    try:
        with _removed_on_terminating_signal(tmp), os.fdopen(fd, "w+b") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        _BEING_WRITTEN.discard(tmp)
    _fsync_dir(path.parent)


@contextmanager
def folder_written_whole(destination: Path, replaceable: Callable[[str], bool]) -> Iterator[Path]:
    """Yield a new empty temporary folder beside ``destination`` to write into; when the block returns, the folder
    takes ``destination``'s place, so a reader sees the previous folder or the new one, never a mix of two runs.

    An existing ``destination`` is replaced whole only when every entry in it is a name ``replaceable`` accepts (what
    an earlier export wrote); one holding anything else is refused before anything is written. A block that raises
    leaves ``destination`` as it was and removes the temporary folder; a process killed meanwhile leaves it behind, and
    a later write into the same parent removes it once its writer is dead (:func:`remove_stale_temp_files`).

    Raises:
        OutputDirectoryError: ``destination`` is a file, or a folder holding entries an export does not write.
    """
    check_output_folder(destination, replaceable)
    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(destination.parent)
    tmp = destination.parent / f".{destination.name}.lf-{pid_space_tag()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        yield tmp
        for entry in os.scandir(tmp):
            _fsync_path(entry.path)
        _fsync_path(str(tmp))
        if destination.exists():
            # a folder cannot be renamed over a non-empty one: the old one steps aside under a temp name first
            old = tmp.with_name(f".{destination.name}.lf-{pid_space_tag()}-{os.getpid()}-{secrets.token_hex(4)}.tmp")
            os.replace(destination, old)
            try:
                os.replace(tmp, destination)
            except BaseException:
                os.replace(old, destination)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, destination)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(destination.parent)


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


# signals whose default action ends the process; a handler of anyone else's is left alone
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)  # SIGINT raises KeyboardInterrupt, which removes it too


@contextmanager
def _removed_on_terminating_signal(tmp: Path) -> Iterator[None]:
    """While ``tmp`` is written: a terminating signal that no one handles removes it, then ends the process as that
    signal would have (SIGKILL cannot be caught: its temp file is removed by a later write, see above)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    unhandled = [s for s in _TERMINATING if signal.getsignal(s) == signal.SIG_DFL]

    def end(signum: int, frame: Any) -> None:
        tmp.unlink(missing_ok=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for signum in unhandled:
        signal.signal(signum, end)
    try:
        yield
    finally:
        for signum in unhandled:
            signal.signal(signum, signal.SIG_DFL)


def remove_temp_files_being_written() -> list[Path]:
    """Delete the temp files :func:`write_file_atomic` is writing in this process now, and return them: for a process
    about to exit at once (``os._exit``), which leaves every target file as it was. Safe in a signal handler."""
    removed = []
    for tmp in _BEING_WRITTEN.copy():  # one C call under the GIL: the main thread cannot change it meanwhile
        try:
            tmp.unlink()
            removed.append(tmp)
        except FileNotFoundError:
            continue  # renamed over its target a moment ago: that file is whole
    return removed


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
        if match is None or entry.is_symlink():
            continue
        try:
            idle = now - entry.stat(follow_symlinks=False).st_mtime
            dead = match["space"] == space and not process_runs(int(match["pid"]))
            if dead or idle > STALE_TEMP_SECONDS:
                if entry.is_dir(follow_symlinks=False):  # a folder being written whole (folder_written_whole)
                    shutil.rmtree(entry.path)
                else:
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


def process_runs(pid: int) -> bool:
    """Whether a process with this pid runs in this pid namespace (under any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it runs, under another user
    return True


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
