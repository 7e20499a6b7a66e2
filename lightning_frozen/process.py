"""How this process ends and what it leaves behind, with one owner each: the package's signal handlers and the
watchdog that bounds a stop, the files this process is writing when it must exit at once, and the sweeping of files
that dead processes left.

Why the watchdog reads a wakeup fd and how a dead process's file is told apart: docs/internals.md, "How a process
ends".
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import select
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, Optional, TypeVar, Union

T = TypeVar("T")

# The ports below the kernel's ephemeral range that a rendezvous chooses from (see rendezvous_port)
RENDEZVOUS_PORTS = 12000
# A file nobody has written to for this long is stale whoever wrote it (another machine or container, or a reused pid)
STALE_SECONDS = 3600.0
# `<prefix>-<pid space>-<pid>-<random><suffix>` (8 hex digits: lightning-frozen 0.1's host-name tag, stale by age only)
_OWNED = r"-(?P<space>[0-9a-f]{16}|[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]+"

_writing: set[Path] = set()  # temp files and folders this process is writing now
_writing_lock = threading.Lock()  # against the watchdog's exit; no signal handler takes it
_exiting = [False]  # set once an exit at once has begun: nothing is renamed into place any more


class ProcessExitingError(RuntimeError):
    """This process is exiting at once (a second stop signal, or its stop deadline passed): no file is published."""


class StopSignals:
    """``handler`` set for ``signums`` in the main thread, and a watchdog thread started with it: ``grace`` seconds
    after the first of these signals, or at once after a second, it calls :func:`exit_now` with ``status(signum)``
    and ``before_exit``. :meth:`close` puts back the handlers and the wakeup fd found, and ends the watchdog."""

    def __init__(
        self,
        signums: Sequence[int],
        handler: Callable[[int, Optional[FrameType]], Any],
        grace: float,
        status: Callable[[int], int],
        before_exit: Callable[[], None],
    ) -> None:
        self.signums, self.handler, self.grace = tuple(signums), handler, grace
        self._status, self._before_exit = status, before_exit
        self.before = {signum: signal.getsignal(signum) for signum in self.signums}
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # CPython's C handler writes to it: it must never block
        self._closed = False
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for signum in self.signums:
            signal.signal(signum, handler)
        _installed[:] = [self]
        threading.Thread(target=self._watch, name="lightning-frozen stop watchdog", daemon=True).start()

    def close(self) -> None:
        """Put back the handlers (where still this one's) and the wakeup fd found, and end the watchdog."""
        if self._closed:
            return
        for signum, before in self.before.items():
            if signal.getsignal(signum) == self.handler and before is not None:
                signal.signal(signum, before)
        signal.set_wakeup_fd(self._previous_fd)
        _installed.clear()
        self._closed = True
        os.write(self._write, b"\0")  # no signal has number 0: it wakes the watchdog to end
        os.close(self._write)  # here, not by the watchdog: its number could be another file's by the write above

    def _watch(self) -> None:
        first, deadline = 0, float("inf")
        try:
            while True:
                ready, _, _ = select.select([self._read], [], [], max(0.0, min(deadline - time.monotonic(), 3600.0)))
                if not ready:
                    if time.monotonic() >= deadline:
                        why = f"the rank did not stop within {self.grace:g} s"
                        exit_now(self._status(first), why, self._before_exit)
                    continue
                # in order: a signal that came before close() (a second one its handler saw) is acted on first
                received, closed, _ = os.read(self._read, 512).partition(b"\0")
                if self._previous_fd >= 0 and received:  # whoever set a wakeup fd before (asyncio) still hears them
                    with suppress(OSError):
                        os.write(self._previous_fd, received)
                for signum in (s for s in received if s in self.signums):
                    if first:
                        why = f"a second {signal.Signals(signum).name} arrived"
                        exit_now(self._status(signum), why, self._before_exit)
                    first, deadline = signum, time.monotonic() + self.grace
                if closed or self._closed:
                    return
        finally:
            os.close(self._read)


_installed: list[StopSignals] = []  # the run's, while set: a forked child (a DataLoader worker) takes it off


def _not_in_a_forked_child() -> None:
    """In a child forked while a run's handler is set (a DataLoader worker): the handlers found before, no wakeup fd,
    so that its SIGTERM ends it and does not reach the rank's watchdog."""
    for watch in _installed:
        for signum, before in watch.before.items():
            signal.signal(signum, signal.SIG_DFL if before is None else before)
        signal.set_wakeup_fd(-1)
    _installed.clear()


os.register_at_fork(after_in_child=_not_in_a_forked_child)


def exit_now(status: int, why: str, before_exit: Callable[[], None] = lambda: None) -> NoReturn:
    """End this process at once with ``status``: the temp files and folders it is writing removed first (the targets
    stay as they were), ``why`` written to stderr, then ``before_exit()``. Safe from any thread."""
    removed = _remove_being_written()
    unfinished = f" (removed the unfinished {', '.join(p.name for p in removed)})" if removed else ""
    # straight to stderr: the main thread may hold the logging locks
    os.write(2, f"lightning-frozen: {why}; exiting now with status {status}{unfinished}.\n".encode())
    before_exit()
    os._exit(status)


def exiting() -> None:
    """Mark that this process exits at once (from a signal handler, before the watchdog does it): from here on no temp
    file is renamed into place."""
    _exiting[0] = True


def start_writing(tmp: Path, create: Callable[[], T]) -> T:
    """``create()`` ``tmp`` (a temp file or folder) and register it, as one step: an exit at once removes it.

    Raises:
        ProcessExitingError: the process is exiting at once.
    """
    with _writing_lock:
        if _exiting[0]:
            raise ProcessExitingError(f"not writing {tmp}: this process is exiting")
        made = create()
        _writing.add(tmp)
    return made


def publish(tmp: Path, rename: Callable[[], None]) -> None:
    """``rename()`` ``tmp`` into place and forget it, as one step, unless the process is exiting at once.

    Raises:
        ProcessExitingError: the process is exiting at once (``tmp`` stays registered: the exit removes it).
    """
    with _writing_lock:
        if _exiting[0]:
            raise ProcessExitingError(f"not renaming {tmp}: this process is exiting")
        rename()
        _writing.discard(tmp)


def abandon(tmp: Path) -> None:
    """Remove ``tmp`` (a write failed) and forget it; left to the exit at once when one has begun, which says so."""
    with _writing_lock:
        if not _exiting[0]:
            _remove(tmp)
            _writing.discard(tmp)


def _remove_being_written() -> list[Path]:
    acquired = _writing_lock.acquire(timeout=1.0)  # held for a rename at most; never wait long to exit
    try:
        _exiting[0] = True
        removed = [tmp for tmp in list(_writing) if _remove(tmp)]
        _writing.clear()
        return removed
    finally:
        if acquired:
            _writing_lock.release()


def _remove(path: Path) -> bool:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return False
    return True


# signals whose default action ends the process; a handler of anyone else's is left alone
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)  # SIGINT raises KeyboardInterrupt, which removes it too


@contextmanager
def removed_if_terminated(tmp: Path) -> Iterator[None]:
    """While ``tmp`` is written: a terminating signal that no one handles removes it, then ends the process as that
    signal would have (SIGKILL cannot be caught: a later sweep removes its file, :func:`remove_dead_files`)."""
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


def owned_name(prefix: str, suffix: str = "") -> str:
    """A new name ``<prefix>-<pid space>-<pid>-<random><suffix>`` that says which process made it, for
    :func:`remove_dead_files`."""
    return f"{prefix}-{pid_space_tag()}-{os.getpid()}-{secrets.token_hex(4)}{suffix}"


def owned_names(prefix: str, suffix: str = "") -> re.Pattern[str]:
    """The names :func:`owned_name` makes for ``prefix`` and ``suffix`` (regular expressions, matched whole)."""
    return re.compile(f"^{prefix}{_OWNED}{suffix}$")


def remove_dead_files(folder: Path, names: re.Pattern[str]) -> list[Path]:
    """Delete the entries of ``folder`` (files, or folders with what they hold) that :func:`dead_files` finds; return
    them."""
    removed: list[Path] = []
    for path, _ in dead_files(folder, names):
        with suppress(OSError):  # renamed by another process meanwhile, or not this user's to remove
            if _remove(path):
                removed.append(path)
    return removed


def dead_files(folder: Path, names: re.Pattern[str]) -> list[tuple[Path, re.Match[str]]]:
    """The entries of ``folder`` (no links, none of another user's) whose names ``names`` matches
    (:func:`owned_names`) and whose process is gone in this pid space or which are ``STALE_SECONDS`` old, each with its
    name's match."""
    found: list[tuple[Path, re.Match[str]]] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return found
    space, now = pid_space_tag(), time.time()
    for entry in entries:
        match = names.match(entry.name)
        if match is None or entry.is_symlink():
            continue
        try:
            status = entry.stat(follow_symlinks=False)
        except OSError:  # removed or renamed by another process meanwhile
            continue
        if status.st_uid != os.getuid():
            continue
        dead = match["space"] == space and not process_runs(int(match["pid"]))
        if dead or now - status.st_mtime > STALE_SECONDS:
            found.append((Path(entry.path), match))
    return found


def cache_dirs() -> list[Path]:
    """Where the package may keep what it builds (the CPU kernels, the frozen codes), in order:
    ``$LIGHTNING_FROZEN_CACHE``, ``$XDG_CACHE_HOME/lightning_frozen``, ``~/.cache/lightning_frozen``, each where it is
    set."""
    dirs = []
    if os.environ.get("LIGHTNING_FROZEN_CACHE"):
        dirs.append(Path(os.environ["LIGHTNING_FROZEN_CACHE"]))
    if os.path.isabs(os.environ.get("XDG_CACHE_HOME", "")):  # the XDG spec ignores a relative one
        dirs.append(Path(os.environ["XDG_CACHE_HOME"]) / "lightning_frozen")
    home = os.path.expanduser("~")  # not Path.home(): it raises where HOME is unset and the uid has no account
    if os.path.isabs(home):
        dirs.append(Path(home) / ".cache" / "lightning_frozen")
    return dirs


CODE_CACHE = "LIGHTNING_FROZEN_CODE_CACHE"  # the code cache's folder, where the strategy's argument does not say
CodeCacheSetting = Union[bool, str, os.PathLike, None]


def code_cache_place(setting: CodeCacheSetting) -> Optional[Path]:
    """The code cache's folder for the strategy's ``code_cache`` argument (``base/code_cache.py``): False is none, a
    path is that folder, True ``$LIGHTNING_FROZEN_CODE_CACHE``, else ``codes`` in the first of :func:`cache_dirs`."""
    if setting is False:
        return None
    if setting is not None and setting is not True:
        return Path(setting).expanduser()
    if os.environ.get(CODE_CACHE):
        return Path(os.environ[CODE_CACHE]).expanduser()
    homes = cache_dirs()
    return homes[0] / "codes" if homes else None


def machine_tag() -> str:
    """A tag shared by the processes of one running kernel (its boot id; without ``/proc``: the host name)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def pid_space_tag() -> str:
    """A tag shared by exactly the processes whose pids this process can check: same kernel boot, same pid namespace
    (without ``/proc``: the host name)."""
    try:
        space = f"{machine_tag()}:{os.stat('/proc/self/ns/pid').st_ino}"
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


def rendezvous_port() -> int:
    """A port free now, chosen at random from the ``RENDEZVOUS_PORTS`` below the kernel's ephemeral range, for rank 0
    to listen on. A port the kernel hands out (a bind to port 0, Lightning's choice) comes from the range it hands
    every outgoing connection's from: between the choice and rank 0's bind, one of another process's (gloo opens
    many) was handed it, and rank 0 failed with EADDRINUSE while rank 1 waited for it until killed."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    choose = secrets.SystemRandom()
    for _ in range(100):
        port = choose.randrange(max(1024, low - RENDEZVOUS_PORTS), low)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))  # every address, as the store binds: one listening on loopback only counts
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])
