"""How a process ends (issue 45, ``lightning_frozen/process.py``): the watchdog set up before any signal ends the
process ``grace`` seconds after one, or at once after a second, even while the main thread never runs the handler,
removing the file being written first; one sweeper removes dead processes' temp files and shared-memory files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from lightning_frozen import process
from lightning_frozen.checkpoint import atomic_files


def _forked(run: Callable[[], None]) -> int:
    """``run()`` in a forked child (which holds the imports already); its exit status, negative for a signal."""
    child = os.fork()
    if child == 0:
        try:
            run()
        finally:
            os._exit(1)  # never back into pytest
    _, status = os.waitpid(child, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _write_while_signalled(target: Path, how: str) -> None:
    atomic_files.write_file_atomic(target, lambda handle: handle.write(b"the previous checkpoint"))
    process.StopSignals([signal.SIGTERM], lambda s, f: None, 1.0, lambda s: 128 + s, lambda: None)
    if how == "stuck":  # the main thread never runs the handler: the kernel gives the signal to another thread
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def write(handle: IO[bytes]) -> None:
        handle.write(b"half of the next one")
        handle.flush()
        target.with_name("signalled").write_text(str(time.monotonic()))
        os.kill(os.getpid(), signal.SIGTERM)
        if how == "second":
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    atomic_files.write_file_atomic(target, write)


@pytest.mark.parametrize("how", ["deadline", "second", "stuck"])
def test_the_watchdog_ends_the_process_and_removes_the_file_being_written(
    tmp_path: Path, capfd: pytest.CaptureFixture, how: str
) -> None:
    target = tmp_path / "last.ckpt"
    assert _forked(lambda: _write_while_signalled(target, how)) == 128 + signal.SIGTERM
    took = time.monotonic() - float((tmp_path / "signalled").read_text())
    why = "a second SIGTERM arrived" if how == "second" else "the rank did not stop within 1 s"
    stderr = capfd.readouterr().err
    assert f"lightning-frozen: {why}; exiting now with status 143 (removed the unfinished .last.ckpt.lf-" in stderr
    assert took < 15  # not the 30 s the write sleeps: "stuck" never ran the handler, the watchdog counted anyway
    assert target.read_bytes() == b"the previous checkpoint"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "signalled"]


def test_one_sweeper_removes_dead_processes_files_and_keeps_live_ones(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = process.owned_names("lightning-frozen")  # the shared-memory files of zero/frozen_files.py
    mine = tmp_path / process.owned_name("lightning-frozen")
    gone = tmp_path / mine.name.replace(f"-{os.getpid()}-", f"-{dead.pid}-")
    folder = tmp_path / process.owned_name(".adapter.lf", ".tmp").replace(f"-{os.getpid()}-", f"-{dead.pid}-")
    other = tmp_path / "lightning-frozen-notes"
    for path in (mine, gone, other):
        path.write_bytes(b"codes")
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    assert process.remove_dead_files(tmp_path, names) == [gone]
    assert process.remove_dead_files(tmp_path, process.owned_names(r"\..+\.lf", r"\.tmp")) == [folder]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([mine.name, other.name])


def _export(folder: Path, content: bytes) -> None:
    with atomic_files.folder_written_whole(folder, lambda name: name == "adapter_model.bin") as tmp:
        (tmp / "adapter_model.bin").write_bytes(content)


def _killed_after_rename(folder: Path, renames: int) -> None:
    """Replace ``folder``'s export with a new one, killed (SIGKILL) right after its ``renames``-th rename."""
    replace, done = os.replace, []

    def replace_then_killed(source: object, target: object) -> None:
        replace(source, target)
        done.append(target)
        if len(done) == renames:
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace_then_killed  # in the forked child only
    _export(folder, b"the new export")


@pytest.mark.parametrize("renames", [1, 2, 3], ids=["old-moved-aside", "new-in-place", "old-renamed-to-remove"])
def test_an_export_replaced_by_a_process_killed_at_any_rename_leaves_a_whole_one(tmp_path: Path, renames: int) -> None:
    folder = tmp_path / "adapter"
    _export(folder, b"the earlier export")
    assert _forked(lambda: _killed_after_rename(folder, renames)) == -signal.SIGKILL
    atomic_files.remove_stale_temp_files(tmp_path)  # what the next write into the parent runs first
    expected = b"the earlier export" if renames == 1 else b"the new export"
    assert (folder / "adapter_model.bin").read_bytes() == expected
    assert sorted(path.name for path in tmp_path.iterdir()) == ["adapter"]  # nothing else left, whole or half
    _export(folder, b"the next export")  # and the next export replaces it as usual
    assert (folder / "adapter_model.bin").read_bytes() == b"the next export"


def _fork_a_worker_that_is_terminated() -> None:
    process.StopSignals([signal.SIGTERM], lambda s, f: None, 1.0, lambda s: 128 + s, lambda: None)
    worker = os.fork()
    if worker == 0:  # a DataLoader worker, shut down by its loader
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        os._exit(0)
    _, status = os.waitpid(worker, 0)
    time.sleep(2)  # past the grace: the rank's watchdog must not have counted the worker's signal
    os._exit(200 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0)


def test_a_forked_childs_sigterm_ends_the_child_and_never_reaches_the_ranks_watchdog() -> None:
    assert _forked(_fork_a_worker_that_is_terminated) == 200 + signal.SIGTERM
