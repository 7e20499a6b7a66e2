"""Faults, untrusted files and many ranks: a training process SIGKILLed while it writes checkpoints, the temp files a
killed writer leaves, checkpoints that carry pickled objects or plant links, two simulated nodes on loopback, and
ranks that raise, fail to write or hang, or leave gloo work in flight at exit."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lightning_frozen
from lightning_frozen import CheckpointFormatError, lightning_seam, process, read_checkpoint
from lightning_frozen.checkpoint import atomic_files, file
from lightning_frozen.format import layout
from lightning_frozen.zero.compute import gloo_exit
from tests.distributed import EXIT_HOOK, SCRIPTS, fresh_env, launch, read_reports, run_in_this_process, run_script
from tests.models import AdapterModel, StockDeepSpeedOnCPU, cpu_trainer, regression_data

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
        env=fresh_env(OMP_NUM_THREADS="1"),
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


@pytest.mark.slow
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
    path = folder / f".{name}.lf-{host or process.pid_space_tag()}-{pid}-0123abcd.tmp"
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
        _plant_temp_file(tmp_path, "last.ckpt", live, host="0badc0de", age=2 * process.STALE_SECONDS),
    ]
    kept = [
        _plant_temp_file(tmp_path, "last.ckpt", live),  # a writer of this pid namespace that still runs
        _plant_temp_file(tmp_path, "last.ckpt", dead.pid, host="0badc0de"),  # another host's, written to just now
        _plant_temp_file(tmp_path, "last.ckpt", dead.pid, host="0123456789abcdef"),  # another container's, just now
    ]
    foreign = tmp_path / ".notes.tmp"  # not named like ours
    foreign.write_text("mine")

    file.write_atomic({"value": torch.arange(3)}, tmp_path / "last.ckpt")

    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept) and foreign.exists()
    assert torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=True)["value"], torch.arange(3))


_BLOCKED_WRITER = """
import pathlib, sys, time
sys.path.insert(0, {repo!r})
from lightning_frozen.checkpoint import atomic_files

def write(handle):
    handle.write(b"half a checkpoint")
    handle.flush()
    pathlib.Path({ready!r}).write_text("")
    while not pathlib.Path({release!r}).exists():
        time.sleep(0.01)

atomic_files.write_file_atomic(pathlib.Path({target!r}), write)
"""


def _pid_not_running_here() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(pid for pid in range(pid_max - 1, 300, -1) if not process.process_runs(pid))


def test_a_live_writer_in_another_container_with_the_same_host_name_keeps_its_temp_file(tmp_path: Path) -> None:
    # a container on the same machine: same host name and kernel, its own pid namespace, where the writer's pid is
    # one that runs no process here (Linux lets root pick the next pid of a fresh namespace)
    pid = _pid_not_running_here()
    script = _BLOCKED_WRITER.format(
        repo=str(Path(__file__).parents[1]),
        ready=str(tmp_path / "ready"),
        release=str(tmp_path / "release"),
        target=str(tmp_path / "last.ckpt"),
    )
    command = f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && {shlex.quote(sys.executable)} -c {shlex.quote(script)}"
    try:
        writer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", command])
    except FileNotFoundError:
        pytest.skip("needs util-linux `unshare`")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            if writer.poll() is not None:
                pytest.skip(f"cannot start a process in a new pid namespace here (unshare exited {writer.returncode})")
            assert time.monotonic() < deadline, "the writer in the other namespace did not start"
            time.sleep(0.01)
        [temp] = _temp_files(tmp_path)
        assert f"-{pid}-" in temp  # its pid there, which runs nothing here
        assert atomic_files.remove_stale_temp_files(tmp_path) == []
        (tmp_path / "release").write_text("")
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
    assert (tmp_path / "last.ckpt").read_bytes() == b"half a checkpoint"


def test_checkpoint_files_get_the_mode_the_umask_allows(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        file.write_atomic({"value": torch.arange(3)}, tmp_path / "shared.ckpt")
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
        target = folder / f".last.ckpt.lf-{process.pid_space_tag()}-{pid}-0123abcd.tmp"
        if planted == "link":
            target.symlink_to(outside)
        else:
            target.write_text("keep me")
    file.write_atomic({"value": torch.arange(3)}, folder / "last.ckpt")
    assert outside.read_text() == "keep me"


# ---------------------------------------------------------------------------------------------- untrusted files


class _Payload:
    """Unpickling it runs a shell command that leaves a marker file: the test fails if it ever runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real checkpoints, ours and a stock DeepSpeed directory, each with a pickled object slipped in."""
    tmp = tmp_path_factory.mktemp("hostile")
    marker = tmp / "executed"
    trainer = cpu_trainer(max_steps=1)
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(tmp / "adapter.ckpt")
    checkpoint = torch.load(tmp / "adapter.ckpt", weights_only=True)
    checkpoint["hyper_parameters"]["width"] = _Payload(marker)
    torch.save(checkpoint, tmp / "hostile.ckpt")
    torch.save(checkpoint, tmp / "hostile5.ckpt", pickle_protocol=5)

    stock = cpu_trainer(StockDeepSpeedOnCPU(stage=3), max_steps=1)
    stock.fit(AdapterModel(), regression_data())
    stock.save_checkpoint(tmp / "stock.ckpt")
    shard = next((tmp / "stock.ckpt").glob("checkpoint/*model_states.pt"))
    state = torch.load(shard, weights_only=False)
    state["hyper_parameters"] = {"width": _Payload(marker)}
    torch.save(state, shard)
    return {"dir": tmp, "marker": marker, "stock": tmp / "stock.ckpt"}


@pytest.mark.parametrize("name", ["hostile", "hostile5"])
def test_every_load_path_refuses_pickled_objects_unexecuted(hostile: dict[str, Path], name: str) -> None:
    path = hostile["dir"] / f"{name}.ckpt"
    refused = pytest.raises(CheckpointFormatError, match=rf"{name}.ckpt holds pickled Python objects.*never holds")
    with refused:
        read_checkpoint(path)
    with refused:
        lightning_frozen.load_adapter(AdapterModel(), path)
    with refused:
        lightning_frozen.load_from_checkpoint(AdapterModel, path)
    with refused:
        lightning_frozen.export_peft_adapter(path, hostile["dir"] / "peft")
    with refused:
        cpu_trainer(max_steps=2).fit(AdapterModel(), regression_data(), ckpt_path=path)
    with refused:
        cpu_trainer().validate(AdapterModel(), regression_data(), ckpt_path=path)
    assert not hostile["marker"].exists()
    assert not (hostile["dir"] / "peft").exists()


def test_the_pickled_object_is_named_when_it_can_be_read_statically(hostile: dict[str, Path]) -> None:
    with pytest.raises(CheckpointFormatError, match=r"hostile.ckpt holds pickled Python objects \(posix.system\)"):
        read_checkpoint(hostile["dir"] / "hostile.ckpt")


def test_convert_refuses_a_deepspeed_shard_with_other_objects(hostile: dict[str, Path]) -> None:
    out = hostile["dir"] / "converted.ckpt"
    with pytest.raises(CheckpointFormatError, match=r"model_states.pt holds Python objects .*\(posix.system\)"):
        lightning_frozen.convert_deepspeed_checkpoint(hostile["stock"], out)
    assert not hostile["marker"].exists() and not out.exists()


def _peft_checkpoint(path: Path) -> Path:
    """A minimal file export accepts: one LoRA weight and the mapping to its PEFT key (no model needed)."""
    peft = {"keys": {"lora_a": "base_model.model.layer.lora_A.weight"}, "config": {"peft_type": "LORA", "r": 4}}
    file.write_atomic(
        {
            layout.FORMAT_KEY: {"format_version": layout.FORMAT_VERSION},
            "state_dict": {"lora_a": torch.ones(4, 8)},
            "frozen_base": {"reference": "my-base", "fingerprint": {}, "peft": peft},
        },
        path,
    )
    return path


def test_export_never_writes_through_a_link_nor_deletes_what_is_not_its_own(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source = _peft_checkpoint(tmp_path / "peft.ckpt")
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    folder = tmp_path / "adapter"
    folder.mkdir()
    # a fixed temp name was a way to write through a planted link; the user's own file is never replaced
    for planted in (".adapter_model.safetensors.tmp", "README.md"):
        if planted.endswith(".tmp"):
            (folder / planted).symlink_to(outside)
        else:
            (folder / planted).write_text("mine")
        with pytest.raises(NotADirectoryError, match=f"adapter holds {re.escape(planted)}, which an export does not"):
            lightning_frozen.export_peft_adapter(source, folder)
        assert outside.read_text() == "keep me" and sorted(p.name for p in folder.iterdir()) == [planted]
        (folder / planted).unlink()

    (folder / "adapter_model.safetensors").symlink_to(outside)  # a link where the weights go: replaced, not followed
    lightning_frozen.export_peft_adapter(source, folder)
    assert outside.read_text() == "keep me" and not (folder / "adapter_model.safetensors").is_symlink()
    assert torch.equal(
        load_file(folder / "adapter_model.safetensors")["base_model.model.layer.lora_A.weight"], torch.ones(4, 8)
    )
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "my-base"


# ---------------------------------------------------------------------------------------------- many ranks


def _launch(folder: Path, *args: str, nodes: int = 1, timeout: float = 120) -> tuple[list[int], str, float]:
    """Run ``many_ranks.py`` under Lightning's launcher (1 node, 2 processes), or as ``nodes`` simulated nodes of one
    process each. Returns the exit codes, the output of all and the seconds until the last one ended."""
    devices = ["--devices=1", f"--num-nodes={nodes}"] if nodes > 1 else ["--devices=2"]
    codes, outputs, seconds = launch("many_ranks.py", f"--dir={folder}", *devices, *args, nodes=nodes, timeout=timeout)
    return codes, "\n".join(outputs), seconds


def _processes_running(argument: str) -> list[int]:
    """Pids of processes whose command line holds ``argument``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and argument.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_two_simulated_nodes_fit_checkpoint_resume_and_validate(tmp_path: Path) -> None:
    codes, output, _ = _launch(tmp_path, nodes=2)
    assert codes == [0, 0], output[-6000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["world_size"] == 2 and r["steps"] == [4, 8] for r in reports), reports
    resumed = read_checkpoint(tmp_path / "resumed.ckpt")
    assert resumed["lightning_frozen"]["world_size"] == 2 and resumed["global_step"] == 8
    # each rank validated half of the data from the resumed file: together, the loss of the whole under load_adapter
    loaded = lightning_frozen.load_adapter(AdapterModel(), tmp_path / "resumed.ckpt").eval()
    x, y = next(iter(regression_data(batch_size=64)))
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(loaded(x), y).item()
    assert sum(r["val_loss"] for r in reports) / 2 == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_run_with_its_error(tmp_path: Path) -> None:
    codes, output, seconds = _launch(tmp_path, "--fail=step", "--fail-rank=1")
    assert codes[0] != 0 and "<killed" not in output
    assert "ValueError: training_step failed on rank 1 on purpose" in output
    assert seconds < 90 and not _processes_running(str(tmp_path))


@pytest.mark.slow
def test_a_failed_checkpoint_write_on_node_zero_ends_both_nodes(tmp_path: Path) -> None:
    (tmp_path / "last.ckpt").mkdir()  # a stock DeepSpeed checkpoint in the way: rank 0, the writer, refuses it
    (tmp_path / "last.ckpt" / "latest").write_text("checkpoint")
    codes, output, seconds = _launch(tmp_path, nodes=2)
    assert 0 not in codes and "<killed" not in output, output[-6000:]
    assert "CheckpointNotFoundError" in output and "last.ckpt is a directory" in output
    assert seconds < 90 and (tmp_path / "last.ckpt" / "latest").read_text() == "checkpoint"


@pytest.mark.slow
def test_a_hung_rank_is_ended_by_the_collective_timeout_and_not_left_behind(tmp_path: Path) -> None:
    codes, output, seconds = _launch(tmp_path, "--fail=hang", "--fail-rank=1", "--timeout=10")
    assert codes[0] != 0 and "<killed" not in output
    assert "Timed out waiting 10000ms" in output
    time.sleep(0.5)  # the SIGKILLed rank is reaped by init, not by us
    assert seconds < 90 and not _processes_running(str(tmp_path))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="reads Linux's /proc syscall numbers")
def test_gloo_workers_are_idle_only_when_no_collective_waits_for_a_peer() -> None:
    """Two ranks of a gloo group in this process, one thread each to meet: what the exit hook waits for."""
    store, groups = dist.HashStore(), [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    meeting = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in meeting:
        thread.start()
    for thread in meeting:
        thread.join()
    names = set()
    for task in os.listdir("/proc/self/task"):
        try:  # another thread of this pytest worker (an earlier test's) may end between the listing and the read
            names.add((Path("/proc/self/task") / task / "comm").read_text().strip())
        except FileNotFoundError:
            continue
    assert gloo_exit.GLOO_WORKER_THREAD in names  # the name torch gives its gloo workers
    assert gloo_exit.wait_for_idle_gloo_workers(timeout=5)
    waiting = groups[0].allreduce([torch.ones(4)])  # rank 1 has not called it: rank 0's worker waits for it
    assert not gloo_exit.wait_for_idle_gloo_workers(timeout=0.3)
    groups[1].allreduce([torch.ones(4)]).wait()
    waiting.wait()
    assert gloo_exit.wait_for_idle_gloo_workers(timeout=5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="reads Linux's /proc syscall numbers")
def test_a_gloo_worker_waiting_to_lock_a_mutex_is_not_idle() -> None:
    """A worker inside a collective that waits to lock a mutex gloo's transport thread holds (long, where that thread
    waits for a CPU) waits in a futex without a timeout, as an idle worker does, but with FUTEX_WAIT, not
    FUTEX_WAIT_BITSET. The exit hook took it for idle; its collective then ended during finalization and the rank
    aborted with "terminate called without an active exception" (a CI run on torch 2.14.1). Here a thread named as
    gloo's workers are waits to lock a pthread mutex this thread holds."""
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER (40 bytes on x86_64, 48 on aarch64)
    assert libc.pthread_mutex_lock(mutex) == 0

    def wait_for_the_mutex() -> None:
        Path("/proc/thread-self/comm").write_text(gloo_exit.GLOO_WORKER_THREAD)
        libc.pthread_mutex_lock(mutex)  # ctypes lets go of the GIL meanwhile
        libc.pthread_mutex_unlock(mutex)

    waiter = threading.Thread(target=wait_for_the_mutex)
    waiter.start()
    try:
        syscall = Path(f"/proc/self/task/{waiter.native_id}/syscall")
        futex = {"x86_64": "202", "aarch64": "98"}[platform.machine()]
        deadline = time.monotonic() + 30
        while syscall.read_text().split()[0] != futex and time.monotonic() < deadline:
            time.sleep(0.01)
        assert syscall.read_text().split()[0] == futex
        assert not gloo_exit.wait_for_idle_gloo_workers(timeout=0.3)
    finally:
        libc.pthread_mutex_unlock(mutex)
        waiter.join()


@pytest.mark.slow
def test_every_rank_exits_cleanly_with_gloo_work_in_flight_at_exit(tmp_path: Path) -> None:
    """Collectives whose tensors die as the process exits. With the previous exit hook (the default gloo group
    destroyed, nothing more; ``--exit-hook=destroy-only``) a rank aborted with "terminate called without an active
    exception" in nearly every such run (``benchmarks/exit``)."""
    for attempt in range(3):
        folder = tmp_path / str(attempt)
        # the whole shutdown, the collector's passes included: the exit this test is about
        codes, outputs, _ = launch(
            "gloo_exit.py", f"--dir={folder}", nodes=2, timeout=180, env={"LIGHTNING_FROZEN_TESTS_FULL_EXIT": "1"}
        )
        assert codes == [0, 0] and not any("terminate called" in output for output in outputs), (
            f"attempt {attempt}: exit statuses {codes}\n" + "\n".join(output[-3000:] for output in outputs)
        )
        assert [report["rank"] for report in read_reports(folder)] == [0, 1]


def _inherited_env() -> dict[str, str]:
    """This process's environment as a script it starts inherits it (a notebook's ``subprocess.run``), with
    ``tests/exit_hook`` first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXIT_HOOK), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_a_two_rank_script_started_after_an_in_process_fit_meets_on_a_port_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook, or a test suite, that fits in its own process and then starts a 2-rank script, which inherits its
    environment. The fit used to leave ``MASTER_PORT`` (and ``LOCAL_RANK``) there, and its store listening on that
    port: the script's rank 0 failed with EADDRINUSE every time (issue 63)."""
    for name in lightning_seam.RENDEZVOUS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    run_in_this_process("start_world.py", str(tmp_path / "fit"), "1")
    fit = read_reports(tmp_path / "fit")
    left = {name: os.environ[name] for name in lightning_seam.RENDEZVOUS_VARIABLES if name in os.environ}

    script = subprocess.run(
        [sys.executable, str(SCRIPTS / "start_world.py"), str(tmp_path / "script"), "2"],
        env=_inherited_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert script.returncode == 0, script.stdout[-3000:] + script.stderr[-6000:]
    assert [report["world_size"] for report in read_reports(tmp_path / "script")] == [2]
    assert left == {}
    assert len(fit) == 1 and fit[0]["world_size"] == 1
    with socket.socket() as probe:
        probe.bind(("", fit[0]["port"]))  # no store of the fit's listens on its port any more


@contextmanager
def _busy_connections(held: int = 2000) -> Iterator[None]:
    """Loopback connections made and closed all the time (about a thousand a second), ``held`` of them open at once,
    each on a port of the kernel's ephemeral range: what gloo's connections are to a rank beside them."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=held)
    address, stop, accepted = listener.getsockname(), threading.Event(), []

    def accept() -> None:
        while not stop.is_set():
            connection, _ = listener.accept()
            accepted.append(connection)
            if len(accepted) > held:
                accepted.pop(0).close()

    def connect() -> None:
        open_now: list[socket.socket] = []
        while not stop.is_set():
            try:
                open_now.append(socket.create_connection(address))
            except OSError:
                time.sleep(0.01)  # the range is exhausted for now
            if len(open_now) > held:
                open_now.pop(0).close()
            stop.wait(0.001)  # busy, but leaving the cores to the ranks
        for connection in open_now:
            connection.close()

    threads = [threading.Thread(target=accept, daemon=True), threading.Thread(target=connect, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        threads[1].join()
        with suppress(OSError):
            socket.create_connection(address).close()  # wakes the accepting thread to see the stop
        threads[0].join()
        listener.close()
        for connection in accepted:
            connection.close()


@pytest.mark.slow
def test_two_rank_starts_beside_busy_connections_all_meet_below_the_ephemeral_range(tmp_path: Path) -> None:
    """Four 2-rank starts, two at a time, with ``MASTER_PORT`` unset. Lightning chose rank 0's port by binding port 0,
    in the range the kernel hands every outgoing connection's from; one made before rank 0 bound it took it (issue
    63)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    environment = {k: v for k, v in _inherited_env().items() if k not in lightning_seam.RENDEZVOUS_VARIABLES}
    folders = [tmp_path / str(start) for start in range(4)]
    with _busy_connections():
        for pair in (folders[0:2], folders[2:4]):
            starts = [
                subprocess.Popen(
                    [sys.executable, str(SCRIPTS / "start_world.py"), str(folder), "2"],
                    env=environment,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for folder in pair
            ]
            outputs = [start.communicate(timeout=300)[0] for start in starts]
            assert [start.returncode for start in starts] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    reports = [report for folder in folders for report in read_reports(folder)]
    assert len(reports) == 4
    assert all(report["world_size"] == 2 and report["port"] < low for report in reports), reports


# ---------------------------------------------------------------------------------------------- long runs


@pytest.mark.slow
def test_resident_memory_stays_flat_with_a_save_every_step(tmp_path: Path) -> None:
    """The soak benchmark cut short: 2 ranks, 120 steps, a checkpoint (about 400 KiB) after each one.

    Without a leak RSS creeps by 15-30 KiB per step early on (the allocator settling); a checkpoint kept alive per
    save, on either rank, shows as 400 KiB or more per save.
    """
    out = tmp_path / "soak.json"
    run_script("soak.py", "--steps=120", "--every=1", f"--out={out}", timeout=180)
    summary = json.loads(out.read_text())["summary"]
    assert sorted(summary) == ["0", "1"]
    for rank, figures in summary.items():
        assert figures["saves_measured"] == 89, figures  # the changes between the 90 samples after warm-up
        assert figures["step_with_save_kib"] < 128, (rank, figures)
        assert figures["rss_end_mib"] - figures["rss_warm_mib"] < 16, (rank, figures)


def _write_twice_and_signal_mid_write(target: Path, signum: int) -> None:
    """In a forked child: write ``target`` whole, then half of it again and send ``signum`` to the child itself.
    Forked, not started: the child holds the imports already, and only this process's files are shared with it."""
    pid = os.fork()
    if pid == 0:
        try:
            if signum != signal.SIGKILL:  # its default action (death), even under `nohup` (SIGHUP ignored)
                signal.signal(signum, signal.SIG_DFL)
            atomic_files.write_file_atomic(target, lambda handle: handle.write(b"the previous checkpoint"))

            def write(handle: Any) -> None:
                handle.write(b"half of the next one")
                handle.flush()
                os.kill(os.getpid(), signum)

            atomic_files.write_file_atomic(target, write)
        finally:
            os._exit(1)  # never back into pytest: the signal should have ended the child before
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signum, status


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_mid_write_leaves_the_previous_file_whole_and_no_temp_file(tmp_path: Path, signum: int) -> None:
    target = tmp_path / "last.ckpt"
    _write_twice_and_signal_mid_write(target, signum)
    assert target.read_bytes() == b"the previous checkpoint"
    if signum == signal.SIGKILL:  # nothing can run at SIGKILL: the next write into the folder removes what it left
        assert len(_temp_files(tmp_path)) == 1
        file.write_atomic({"value": torch.arange(3)}, tmp_path / "other.ckpt")
    assert not _temp_files(tmp_path)
