"""Faults: a training process SIGKILLed while it writes checkpoints, and temp files that a killed writer leaves."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_frozen import checkpoint as ckpt_module
from lightning_frozen import read_checkpoint
from tests.distributed import SCRIPTS
from tests.models import AdapterModel, cpu_trainer, regression_data

MAX_STEPS = 40


def _temp_files(folder: Path) -> set[str]:
    return {p.name for p in folder.glob(".*.tmp")} if folder.is_dir() else set()


def _newest(folder: Path) -> tuple[int, Path | None]:
    """The highest global step among the checkpoint files, each of which must open as a whole checkpoint."""
    steps = {path: read_checkpoint(path)["global_step"] for path in sorted(folder.glob("*.ckpt"))}
    if not steps:
        return 0, None
    path = max(steps, key=lambda p: (steps[p], p.name != "last.ckpt"))
    return steps[path], path


def _start(folder: Path, resume: Path | None) -> subprocess.Popen:
    args = [sys.executable, str(SCRIPTS / "checkpoint_every_step.py"), f"--dir={folder}", f"--max-steps={MAX_STEPS}"]
    return subprocess.Popen(
        args + ([f"--resume={resume}"] if resume else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _wait_for(condition: Callable[[], bool], process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the script ended before it was killed:\n{process.stderr.read()[-4000:]}")
        assert time.monotonic() < deadline, "the script made no progress"
        time.sleep(0.0005)


def _saved_since(folder: Path, moment: float) -> bool:
    for path in folder.glob("*.ckpt"):
        try:
            if path.stat().st_mtime > moment:
                return True
        except FileNotFoundError:  # ModelCheckpoint removed it meanwhile
            continue
    return False


def _run_and_kill(folder: Path, resume: Path | None, mid_write: bool, delay: float) -> None:
    """Start the script; once it has saved a checkpoint, SIGKILL it as a checkpoint write begins or after ``delay``."""
    before, begun = _temp_files(folder), time.time()
    process = _start(folder, resume)
    _wait_for(lambda: _saved_since(folder, begun), process)
    if mid_write:
        _wait_for(lambda: bool(_temp_files(folder) - before), process)
    else:
        time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.stderr.close()


def test_sigkill_while_checkpointing_every_step_leaves_whole_files_and_resumes(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    rng = random.Random(6)
    caught_mid_write = 0
    for attempt in range(3):
        step, newest = _newest(folder)
        before = _temp_files(folder)
        (folder / "started.json").unlink(missing_ok=True)
        _run_and_kill(folder, newest, mid_write=attempt % 2 == 0, delay=rng.uniform(0, 0.5))

        # training restarted from the newest whole checkpoint
        assert json.loads((folder / "started.json").read_text())["global_step"] == step
        # every file under a checkpoint name is whole; what the kill interrupted is at most one temp file, and the
        # temp files earlier kills left were removed by this run's first save
        left = _temp_files(folder)
        assert len(left) <= 1 and not (left & before), (before, left)
        caught_mid_write += bool(left)
        assert _newest(folder)[0] > step

    assert caught_mid_write >= 1, "no kill landed inside a checkpoint write"
    step, newest = _newest(folder)
    assert step < MAX_STEPS
    finish = _start(folder, newest)
    _, errors = finish.communicate(timeout=120)
    assert finish.returncode == 0, errors[-4000:]
    assert not _temp_files(folder)
    step, newest = _newest(folder)
    assert step == MAX_STEPS
    resumed = read_checkpoint(newest)

    # three kills and restarts later, the weights are those of one uninterrupted run
    from tests.scripts.checkpoint_every_step import RANK, SAMPLES, WIDTH

    straight = cpu_trainer(max_steps=MAX_STEPS, max_epochs=-1)
    data = regression_data(width=WIDTH, samples=SAMPLES, batch_size=SAMPLES)
    straight.fit(AdapterModel(width=WIDTH, rank=RANK), data)
    straight.save_checkpoint(tmp_path / "straight.ckpt")
    expected = read_checkpoint(tmp_path / "straight.ckpt")
    for name, value in expected["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value)


def _plant_temp_file(folder: Path, name: str, pid: int, host: str | None = None, age: float = 0) -> Path:
    path = folder / f".{name}.lf-{host or ckpt_module._host_tag()}-{pid}-0123abcd.tmp"
    path.write_bytes(b"half a checkpoint")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_a_save_removes_only_the_temp_files_of_dead_writers(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    stale = [
        _plant_temp_file(tmp_path, "last.ckpt", dead.pid),
        _plant_temp_file(tmp_path, "epoch=0-step=3.ckpt", dead.pid),  # another checkpoint name in the same folder
        _plant_temp_file(tmp_path, "last.ckpt", live, host="0badc0de", age=2 * ckpt_module.STALE_TEMP_SECONDS),
    ]
    kept = [
        _plant_temp_file(tmp_path, "last.ckpt", live),  # a writer of this host that still runs
        _plant_temp_file(tmp_path, "last.ckpt", dead.pid, host="0badc0de"),  # another host's, written to just now
    ]
    foreign = tmp_path / ".notes.tmp"  # not named like ours
    foreign.write_text("mine")

    ckpt_module.write_atomic({"value": torch.arange(3)}, tmp_path / "last.ckpt")

    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept) and foreign.exists()
    assert torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=True)["value"], torch.arange(3))


def test_checkpoint_files_get_the_mode_the_umask_allows(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        ckpt_module.write_atomic({"value": torch.arange(3)}, tmp_path / "shared.ckpt")
    finally:
        os.umask(previous)
    assert (tmp_path / "shared.ckpt").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("planted", ["file", "link"])
def test_a_write_never_goes_through_a_planted_temp_name(tmp_path: Path, planted: str) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    folder = tmp_path / "run"
    folder.mkdir()
    # whatever sits under a name a temp file could take is neither overwritten nor followed
    for pid in (os.getpid(), 1):
        target = folder / f".last.ckpt.lf-{ckpt_module._host_tag()}-{pid}-0123abcd.tmp"
        if planted == "link":
            target.symlink_to(outside)
        else:
            target.write_text("keep me")
    ckpt_module.write_atomic({"value": torch.arange(3)}, folder / "last.ckpt")
    assert outside.read_text() == "keep me"
