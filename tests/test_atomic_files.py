"""The sweep of temp files and folders beside a checkpoint or an export (``checkpoint/atomic_files.py``, issue 63
item 4): what a live writer holds stays, however old; a dead writer's leftovers go, except the last copy of an export,
which is put back or kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from contextlib import suppress
from pathlib import Path

import pytest

from lightning_frozen import process
from lightning_frozen.checkpoint import atomic_files

EXPORTED = "adapter_model.bin"
HOUR = 3600.0


def _export(folder: Path, content: bytes) -> None:
    with atomic_files.folder_written_whole(folder, lambda name: name == EXPORTED) as tmp:
        (tmp / EXPORTED).write_bytes(content)


def _pause(signals: Path) -> None:
    (signals / "ready").write_text("")
    while not (signals / "release").exists():
        time.sleep(0.01)


def _write_new(out: Path, signals: Path, paused_at: str) -> None:
    """Write the new checkpoint file or export folder into ``out``, paused where ``paused_at`` says."""
    if paused_at == "tmp file":

        def write(handle) -> None:
            handle.write(b"new")
            handle.flush()
            _pause(signals)

        atomic_files.write_file_atomic(out / "last.ckpt", write)
        return
    if paused_at == "tmp folder":
        with atomic_files.folder_written_whole(out / "adapter", lambda name: name == EXPORTED) as tmp:
            (tmp / EXPORTED).write_bytes(b"new")
            _pause(signals)
        return
    replace = os.replace

    def replace_then_pause(source: object, target: object) -> None:  # the old folder just stepped aside
        replace(source, target)
        if Path(str(source)) == out / "adapter":
            _pause(signals)

    os.replace = replace_then_pause  # in the forked writer only
    _export(out / "adapter", b"new")


def _start_writer(out: Path, signals: Path, paused_at: str) -> int:
    """A forked writer paused mid-write (it holds the imports already); its pid once it is paused."""
    signals.mkdir()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            _write_new(out, signals, paused_at)
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)  # never back into pytest
    deadline = time.monotonic() + 60
    while not (signals / "ready").exists():
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            pytest.fail("the writer exited before it paused")
        assert time.monotonic() < deadline, "the writer did not pause"
        time.sleep(0.01)
    return pid


def _exit_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _target_content(out: Path) -> bytes:
    written = out / "last.ckpt"
    return written.read_bytes() if written.exists() else (out / "adapter" / EXPORTED).read_bytes()


@pytest.fixture(params=["tmp file", "tmp folder", "old folder"])
def paused_writer(request: pytest.FixtureRequest, tmp_path: Path):
    """A writer paused mid-write in another process, what it holds beside its target made two hours old (nothing
    written to them, nor renamed: a rename keeps the mtime): (the folder, its pid, what it holds)."""
    out = tmp_path / "out"
    out.mkdir()
    if request.param == "tmp file":
        atomic_files.write_file_atomic(out / "last.ckpt", lambda handle: handle.write(b"earlier"))
    else:
        _export(out / "adapter", b"earlier")
    pid = _start_writer(out, tmp_path / "signals", request.param)
    try:
        held = sorted((path for path in out.iterdir() if ".lf-" in path.name), key=lambda path: path.suffix)
        expected = [".old", ".tmp"] if request.param == "old folder" else [".tmp"]
        assert [path.suffix for path in held] == expected, held
        assert all(f"-{pid}-" in path.name for path in held)
        then = time.time() - 2 * HOUR
        for path in held:
            os.utime(path, (then, then))
        yield out, pid, held
    finally:
        with suppress(ChildProcessError):  # the test waited for it already
            if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still paused: the test failed before it went on
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def test_what_a_live_writer_holds_is_not_swept_however_old(paused_writer: tuple[Path, int, Path]) -> None:
    out, pid, held = paused_writer
    assert atomic_files.remove_stale_temp_files(out) == []  # what another process writing beside it runs first
    assert all(path.exists() for path in held)
    (out.parent / "signals" / "release").write_text("")
    assert _exit_status(pid) == 0
    assert _target_content(out) == b"new"
    assert [path.name for path in out.iterdir()] in (["last.ckpt"], ["adapter"])  # nothing else left


def test_what_a_killed_writer_left_is_swept(paused_writer: tuple[Path, int, Path]) -> None:
    out, pid, held = paused_writer
    os.kill(pid, signal.SIGKILL)
    assert _exit_status(pid) == -signal.SIGKILL
    removed = atomic_files.remove_stale_temp_files(out)
    assert removed == [path for path in held if path.suffix == ".tmp"]  # the `.old` folder is put back
    assert _target_content(out) == b"earlier"
    assert [path.name for path in out.iterdir()] in (["last.ckpt"], ["adapter"])  # the new `.tmp` folder went too


def _dead_writers_aside(folder: Path, target: str) -> Path:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = process.owned_name(f".{target}.lf", ".old").replace(f"-{os.getpid()}-", f"-{dead.pid}-")
    aside = folder / name
    aside.mkdir()
    (aside / EXPORTED).write_bytes(b"the only copy")
    return aside


@pytest.mark.parametrize("in_its_place", ["a dangling link", "a file"])
def test_a_dead_writers_export_that_cannot_be_put_back_is_kept(tmp_path: Path, in_its_place: str) -> None:
    aside = _dead_writers_aside(tmp_path, "adapter")
    if in_its_place == "a file":
        (tmp_path / "adapter").write_text("a user's notes")
    else:
        (tmp_path / "adapter").symlink_to(tmp_path / "gone")
    assert atomic_files.remove_stale_temp_files(tmp_path) == []
    assert (aside / EXPORTED).read_bytes() == b"the only copy"


def test_a_dead_writers_export_superseded_by_a_newer_one_is_removed(tmp_path: Path) -> None:
    _export(tmp_path / "adapter", b"newer")
    aside = _dead_writers_aside(tmp_path, "adapter")
    assert atomic_files.remove_stale_temp_files(tmp_path) == [aside]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["adapter"]
    assert (tmp_path / "adapter" / EXPORTED).read_bytes() == b"newer"
