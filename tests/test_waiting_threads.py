"""torch's OpenMP threads spin while they wait, and sleep soon while other threads take the process's cores (issue
53): libgomp's default spin of up to 300,000 times holds a core that the thread it waits for needs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import lightning as L
import pytest
import torch

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.format import native_codec
from lightning_frozen.zero.compute import waiting_threads
from tests.models import AdapterModel, cpu_trainer, regression_data

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
pytestmark = pytest.mark.skipif(CPUS < 2, reason="an OpenMP team needs two CPUs")


@pytest.fixture
def threads_as_cpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch on as many threads as the process may use CPUs (the suite runs one), no wait policy of the user's."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(CPUS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """A busy process on every CPU, beside the test's threads."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(CPUS)]
    yield
    for process in busy:
        process.kill()
        process.wait()


def _threads() -> set[int]:
    """The ids of this process's threads now."""
    return set(map(int, os.listdir("/proc/self/task")))


def _once(condition: Callable[[], bool]) -> bool:
    """Whether ``condition()`` holds, waiting up to 10 s for it: a team of OpenMP threads starts and ends on its own."""
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _parallel_work(seconds: float) -> None:
    values, end = torch.ones(1 << 20), time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.add(values, 1)


def test_brief_waits_keep_one_more_thread_in_torchs_openmp_team_and_libgomps_own_come_back(
    threads_as_cpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.add(torch.ones(1 << 21), 1)  # torch's team of as many threads as CPUs exists before the count
    before = _threads()
    monkeypatch.setattr(waiting_threads, "MIN_WINDOW_S", 0.0)
    waits = waiting_threads.for_this_process()
    assert waits is not None and native_codec.torchs_libgomp_alone()
    try:
        # brief from the start: the package's thread and one OpenMP thread of its team of two, in the libgomp torch's
        # team runs in, which then manages more threads than CPUs and spins briefly (libgomp's manual, GOMP_SPINCOUNT)
        assert waits.brief and _once(lambda: len(_threads() - before) == 2)
        parked = _threads() - before
        assert {t.native_id for t in threading.enumerate() if t.name == waiting_threads.THREAD_NAME} < parked
        monkeypatch.setattr(waiting_threads, "CONTENDED_WAIT", 10**9)  # any wait reads as cores of its own
        waits.check()  # the first check starts the count
        assert waits.brief
        waits.check()
        assert not waits.brief and waits.switched == 1
        assert _once(lambda: not parked & _threads())  # libgomp's own waits: the team is gone
        monkeypatch.setattr(waiting_threads, "CONTENDED_WAIT", -1)  # and now as other threads on the cores
        waits.check()
        assert waits.brief and waits.switched == 2 and _once(lambda: len(_threads() - before) == 2)
        parked = _threads() - before
    finally:
        waits.close()
    assert _once(lambda: not parked & _threads())
    assert not any(t.name == waiting_threads.THREAD_NAME for t in threading.enumerate())


def test_busy_processes_on_the_cores_make_the_waits_brief(threads_as_cpus: None, busy_cores: None) -> None:
    waits = waiting_threads.for_this_process()
    assert waits is not None
    try:
        waits.close()  # libgomp's own waits, beside busy processes
        waits.check()
        _parallel_work(waiting_threads.MIN_WINDOW_S + 0.3)
        waits.check()
        assert waits.brief, "the thread waiting for a CPU beside busy processes should read as contended"
    finally:
        waits.close()


def test_the_users_wait_policy_and_a_single_thread_are_left_alone(
    threads_as_cpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        with monkeypatch.context() as env:
            env.setenv(name, "active" if name == "OMP_WAIT_POLICY" else "300000")
            assert waiting_threads.for_this_process() is None
    torch.set_num_threads(1)
    assert waiting_threads.for_this_process() is None


class _SeesTheTeam(L.Callback):
    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_end(self, *args: object) -> None:
        self.seen.append(any(t.name == waiting_threads.THREAD_NAME for t in threading.enumerate()))


@pytest.mark.parametrize(("wait", "seen"), [(-1, [True, True, True]), (10**9, [True, False, False])])
def test_a_cpu_fit_checks_the_waits_at_each_step_and_ends_them_with_the_run(
    threads_as_cpus: None, monkeypatch: pytest.MonkeyPatch, wait: float, seen: list[bool]
) -> None:
    monkeypatch.setattr(waiting_threads, "MIN_WINDOW_S", 0.0)
    monkeypatch.setattr(waiting_threads, "CONTENDED_WAIT", wait)  # every step read as contended, or as not
    sees = _SeesTheTeam()
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), max_steps=3, callbacks=[sees])
    trainer.fit(AdapterModel(width=16), regression_data(width=16))
    assert sees.seen == seen  # brief from the start; the first step's check starts the count
    assert not any(t.name == waiting_threads.THREAD_NAME for t in threading.enumerate())


class _SeesTheTeamInValidation(L.Callback):
    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_validation_batch_end(self, *args: object) -> None:
        self.seen.append(any(t.name == waiting_threads.THREAD_NAME for t in threading.enumerate()))


def test_validation_alone_checks_the_waits_too(threads_as_cpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waiting_threads, "MIN_WINDOW_S", 0.0)
    monkeypatch.setattr(waiting_threads, "CONTENDED_WAIT", 10**9)  # every step read as on cores of its own
    sees = _SeesTheTeamInValidation()
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), callbacks=[sees])
    trainer.validate(AdapterModel(width=16), regression_data(width=16, samples=24))
    assert sees.seen == [True, False, False]  # not brief for a whole run that never trains
    assert not any(t.name == waiting_threads.THREAD_NAME for t in threading.enumerate())


class _Raises(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 2:
            assert any(t.name == waiting_threads.THREAD_NAME for t in threading.enumerate())
            raise RuntimeError("the user's own failure")


def test_a_fit_that_raises_lets_the_sleeping_thread_go(threads_as_cpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waiting_threads, "CONTENDED_WAIT", -1)  # brief throughout: the thread is there when it raises
    monkeypatch.setattr(waiting_threads, "MIN_WINDOW_S", 0.0)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), max_steps=4, callbacks=[_Raises()])
    with pytest.raises(RuntimeError, match="the user's own failure"):
        trainer.fit(AdapterModel(width=16), regression_data(width=16))
    assert not any(t.name == waiting_threads.THREAD_NAME for t in threading.enumerate())
