"""Preemption (issue 18): SIGTERM to one rank or to all of them during a 2-rank ``fit`` stops every rank at the next
step boundary with a whole ``last.ckpt``, whatever the signal interrupted (a forward, a backward, an optimizer step,
a save); a second signal or a rank that cannot stop ends the run at once without a partial file; and a run resumed
after every such stop reaches exactly the weights of a run that was never interrupted. Under SLURM auto-requeue the
requeue signal saves Lightning's HPC checkpoint and requeues the job, which then resumes from it by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from lightning_frozen import FrozenAwareDeepSpeedStrategy, preemption, read_checkpoint
from tests.distributed import read_reports, run_script
from tests.models import AdapterModel, cpu_trainer, regression_data

SIGTERM_STATUS = 128 + signal.SIGTERM


def _run(
    folder: Path, name: str, *args: str, resume: bool = True, status: int = SIGTERM_STATUS
) -> tuple[str, list[dict[str, Any]]]:
    """Run ``preempt.py`` on 2 ranks in ``folder``, which must exit with ``status``: its output and each rank's
    report."""
    arguments = [f"--dir={folder}", f"--report={folder.parent / name}", *["--resume"] * resume, *args]
    result = run_script("preempt.py", *arguments, timeout=300, env={"OMP_NUM_THREADS": "1"}, status=status)
    return result.stdout + result.stderr, read_reports(folder.parent / name)


def _stopped(folder: Path, run: tuple[str, list[dict[str, Any]]], step: int, signalled: list[int]) -> None:
    """Both ranks stopped after ``step``, said why (each naming whether it got the signal) and left ``last.ckpt``."""
    output, reports = run
    assert [r["status"] for r in reports] == [SIGTERM_STATUS] * 2
    assert [r["global_step"] for r in reports] == [step] * 2
    for rank in (0, 1):
        received = "yes" if rank in signalled else "no"
        assert f"rank {rank}: SIGTERM received (on this rank: {received}); stopped after step {step}" in output
    assert read_checkpoint(folder / "last.ckpt")["global_step"] == step
    assert not list(folder.glob(".*.tmp"))


def _same_training_state(expected: dict[str, Any], found: dict[str, Any]) -> None:
    """Same step, Lightning epoch counters, weights and Adam state, bit for bit: a chain of resumes counts epochs (and
    so seeds each epoch's shuffle) as a run never stopped (``lightning_frozen/loops.py``)."""
    assert found["global_step"] == expected["global_step"]
    assert found["loops"]["fit_loop"]["epoch_progress"] == expected["loops"]["fit_loop"]["epoch_progress"]
    assert expected["state_dict"].keys() == found["state_dict"].keys()
    for name, value in expected["state_dict"].items():
        torch.testing.assert_close(found["state_dict"][name], value, rtol=0, atol=0, msg=name)
    expected_state = expected["optimizer_states"][0]["state"]
    for name, state in found["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(value, expected_state[name][key], rtol=0, atol=0, msg=f"{name} {key}")


@pytest.mark.slow
def test_sigterm_at_every_point_of_a_step_stops_both_ranks_and_the_resumed_run_is_exact(tmp_path: Path) -> None:
    straight, chain = tmp_path / "straight" / "ckpt", tmp_path / "chain" / "ckpt"
    _run(straight, "straight", resume=False, status=0)

    # one rank, in the forward of the second step (index 1): Lightning's handler deadlocked here under ZeRO-3
    _stopped(chain, _run(chain, "forward", "--at=forward", "--step=1", "--ranks=1", resume=False), 2, [1])
    _stopped(chain, _run(chain, "backward", "--at=backward", "--step=3", "--ranks=0,1"), 4, [0, 1])
    _stopped(chain, _run(chain, "step", "--at=optimizer_step", "--step=5", "--ranks=0"), 6, [0])
    # rank 0, while it writes the periodic checkpoint of step 7: that file is finished, then the stop saves
    _stopped(chain, _run(chain, "save", "--at=save", "--step=7", "--ranks=0"), 7, [0])
    saved = (chain / "last.ckpt").read_bytes()

    # a second SIGTERM while the stop checkpoint is written: exit at once, the previous last.ckpt whole
    output, _ = _run(chain, "second", "--at=forward", "--step=7", "--ranks=0", "--second")
    assert "a second SIGTERM arrived; exiting now with status 143 (removed the unfinished .last.ckpt" in output
    assert (chain / "last.ckpt").read_bytes() == saved and not list(chain.glob(".*.tmp"))

    # rank 1 never reaches the step boundary: both ranks end at their deadline, nothing written
    output, _ = _run(chain, "stuck", "--at=forward", "--step=8", "--stuck", "--grace=3")
    assert "the rank did not stop within 3 s; exiting now with status 143" in output
    assert (chain / "last.ckpt").read_bytes() == saved and not list(chain.glob(".*.tmp"))

    _run(chain, "end", status=0)
    _same_training_state(read_checkpoint(straight / "final.ckpt"), read_checkpoint(chain / "final.ckpt"))
    assert read_checkpoint(chain / "final.ckpt")["global_step"] == 10


@pytest.mark.parametrize("stopping", [False, True])
def test_an_agreed_stop_keeps_lightnings_observer_from_killing_the_launching_rank(stopping: bool) -> None:
    """Lightning's observer SIGKILLs the launching process once a rank it launched ended non-zero; when a rank ended
    with the agreed stop's status, the launching rank is still finishing its own stop (the race seen in CI)."""
    launching = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands in for rank 0
    rank1 = subprocess.Popen([sys.executable, "-c", f"import sys, time; time.sleep(0.5); sys.exit({SIGTERM_STATUS})"])
    launcher = SimpleNamespace(procs=[rank1])  # Lightning's subprocess launcher: the ranks it started
    # the observer Lightning's launcher starts over that list (`_launch_process_observer(self.procs)`), polling faster
    observer = _ChildProcessObserver(main_pid=launching.pid, child_processes=launcher.procs, sleep_period=0.2)
    observer.start()
    try:
        taken = preemption.stop_watching_ranks(launcher) if stopping else []
        rank1.wait()
        observer.join(timeout=5)
        time.sleep(0.5)
        assert not observer.is_alive()
        assert launching.poll() == (None if stopping else -signal.SIGKILL)
        assert taken == ([rank1] if stopping else [])  # the run still ends those that outlive the stop
    finally:
        launching.kill()
        launching.wait()


class _SignalledAt(AdapterModel):
    """Sends ``signum`` to its own process in the training step of global step 2."""

    signum = signal.SIGTERM

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 2:
            os.kill(os.getpid(), self.signum)
        return super().training_step(batch, batch_idx)


class _RequeuedAt(_SignalledAt):
    signum = signal.SIGUSR1


def test_one_rank_without_a_model_checkpoint_stops_into_the_root_dir_and_runs_the_users_handler(
    tmp_path: Path,
) -> None:
    received: list[int] = []

    def users_handler(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, users_handler)
    try:
        trainer = cpu_trainer(max_steps=5, max_epochs=-1, default_root_dir=tmp_path)
        with pytest.raises(SystemExit) as stop:
            trainer.fit(_SignalledAt(), regression_data(samples=8))
        assert stop.value.code == SIGTERM_STATUS and received == [signal.SIGTERM]
        assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3
        assert signal.getsignal(signal.SIGTERM) is users_handler  # Lightning put back what it found
    finally:
        signal.signal(signal.SIGTERM, previous)


class _HandlerSeen(AdapterModel):
    """Records the SIGTERM handler in each phase after the strategy's setup."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def setup(self, stage: str) -> None:
        self.seen["setup"] = signal.getsignal(signal.SIGTERM)

    def on_fit_start(self) -> None:
        self.seen["on_fit_start"] = signal.getsignal(signal.SIGTERM)

    def train_dataloader(self) -> Any:
        self.seen["train_dataloader"] = signal.getsignal(signal.SIGTERM)
        return regression_data()

    def val_dataloader(self) -> Any:
        self.seen["val_dataloader"] = signal.getsignal(signal.SIGTERM)
        return regression_data()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["training_step"] = signal.getsignal(signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def test_lightnings_broadcasting_handler_never_sees_sigterm_in_any_phase() -> None:
    module, before = _HandlerSeen(), signal.getsignal(signal.SIGTERM)
    cpu_trainer(max_steps=2, num_sanity_val_steps=1, limit_val_batches=1).fit(module)
    assert sorted(module.seen) == ["on_fit_start", "setup", "train_dataloader", "training_step", "val_dataloader"]
    for phase, handler in module.seen.items():
        assert isinstance(getattr(handler, "__self__", None), preemption.Preemption), (phase, handler)
    assert signal.getsignal(signal.SIGTERM) == before  # and what was there before the run is back


@pytest.fixture
def sigusr1_default() -> Iterator[None]:
    """SIGUSR1's default action in this process for the test, whatever the suite was started under (a runner may
    ignore it), and the previous disposition back afterwards."""
    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGUSR1, previous)


def _slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job_id: str) -> None:
    """One SLURM task of job ``job_id``, whose ``scontrol`` writes its arguments to ``<tmp_path>/requeued``."""
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "requeued"}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}:{os.environ['PATH']}")
    slurm = dict(SLURM_NTASKS="1", SLURM_JOB_ID=job_id, SLURM_JOB_NAME="train", SLURM_PROCID="0")
    for key, value in dict(slurm, SLURM_LOCALID="0", SLURM_NODEID="0").items():
        monkeypatch.setenv(key, value)


@pytest.mark.usefixtures("sigusr1_default")
def test_slurm_requeue_saves_the_hpc_checkpoint_requeues_and_the_job_resumes_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slurm_job(tmp_path, monkeypatch, "4242")

    def trainer() -> Any:
        strategy = FrozenAwareDeepSpeedStrategy(cluster_environment=SLURMEnvironment(auto_requeue=True))
        return cpu_trainer(strategy, max_steps=4, max_epochs=-1, default_root_dir=tmp_path)

    with pytest.raises(SystemExit) as stop:
        trainer().fit(_RequeuedAt(), regression_data(samples=8))
    assert stop.value.code == 128 + signal.SIGUSR1
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    assert read_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")["global_step"] == 3
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)  # Lightning put back what it found

    resumed = trainer()
    resumed.fit(
        AdapterModel(), regression_data(samples=8)
    )  # no ckpt_path: Lightning resumes a SLURM job from hpc_ckpt_*
    assert resumed.global_step == 4


class _RequeuedInConfigureModel(AdapterModel):
    loaded = False

    def configure_model(self) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's requeue signal in the middle of the load
        time.sleep(1)  # the rest of the load: the handler only records the signal
        self.loaded = True


@pytest.mark.usefixtures("sigusr1_default")
def test_a_requeue_signal_during_the_load_requeues_without_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    _slurm_job(tmp_path, monkeypatch, "4343")
    strategy = FrozenAwareDeepSpeedStrategy(cluster_environment=SLURMEnvironment(auto_requeue=True))
    module = _RequeuedInConfigureModel()
    with pytest.raises(SystemExit) as stop:
        cpu_trainer(strategy, max_steps=2, default_root_dir=tmp_path).fit(module, regression_data())
    assert module.loaded and module.global_step == 0  # raised after `configure_model`, before any step
    assert stop.value.code == 128 + signal.SIGUSR1
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4343"]
    assert not list(tmp_path.rglob("*.ckpt"))
    assert "SIGUSR1 before the first training step" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)  # the handler found before the run is back


class _SignalledBeforeTraining(AdapterModel):
    """Sends SIGTERM to its own process in the phase ``at`` and records every phase it reaches, that one included."""

    at = ""
    reached: list[str]

    def _reach(self, phase: str) -> None:
        if phase == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.reached.append(phase)  # after the signal too: the handler only records it

    def setup(self, stage: str) -> None:
        self._reach("setup")

    def configure_model(self) -> None:
        self._reach("configure_model")

    def on_train_start(self) -> None:
        self._reach("on_train_start")

    def train_dataloader(self) -> Any:
        return regression_data()

    def val_dataloader(self) -> Any:
        return regression_data()

    def test_dataloader(self) -> Any:
        return regression_data()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._reach(f"sanity {batch_idx}")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._reach(f"test {batch_idx}")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._reach("training_step")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("at", "reached"),
    [
        ("setup", ["setup", "configure_model"]),  # raised after `configure_model`
        ("configure_model", ["setup", "configure_model"]),
        ("sanity 0", ["setup", "configure_model", "sanity 0"]),  # between sanity batches
        ("on_train_start", ["setup", "configure_model", "sanity 0", "sanity 1", "on_train_start"]),  # before batch 0
        ("test 0", ["setup", "configure_model", "test 0"]),  # between the batches of `test`
    ],
)
def test_a_sigterm_before_the_first_step_is_raised_at_the_next_boundary_never_by_the_handler(
    tmp_path: Path, capfd: pytest.CaptureFixture, at: str, reached: list[str]
) -> None:
    module = _SignalledBeforeTraining()
    module.at, module.reached = at, []
    trainer = cpu_trainer(max_steps=2, num_sanity_val_steps=2, limit_val_batches=2, default_root_dir=tmp_path)
    with pytest.raises(SystemExit) as stop:
        trainer.test(module) if at.startswith("test") else trainer.fit(module)
    assert stop.value.code == SIGTERM_STATUS
    assert module.reached == reached
    assert "SIGTERM before the first training step" in capfd.readouterr().err
    assert not list(tmp_path.rglob("*.ckpt"))


class _SlowStep(AdapterModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.3)
        return super().training_step(batch, batch_idx)


def test_a_step_longer_than_the_grace_warns_once_with_the_fix() -> None:
    strategy = FrozenAwareDeepSpeedStrategy(preemption_grace=0.1)
    with pytest.warns(UserWarning, match=r"more than `preemption_grace=0\.1` s") as warned:
        cpu_trainer(strategy, max_steps=3).fit(_SlowStep(), regression_data())
    assert sum("preemption_grace" in str(w.message) for w in warned) == 1
    assert "--signal=TERM@" in str(next(w.message for w in warned if "preemption_grace" in str(w.message)))


def _early_stop(tmp_path: Path, at: str, ranks: str, *extra: str) -> str:
    """Run ``preempt_early.py`` (with ``extra``) signalling ``ranks`` at ``at`` with a grace of 15 s, and check that
    every rank ended within it: the strategy's handler alone saw the signal (Lightning's, which broadcasts inside the
    handler, is never registered) and recorded it, the signalled ranks went on for 2 s (the rest of a load), and the
    strategy's next boundary raised the stop, where no patch is held. The run's output."""
    grace = 15.0
    args = ("--dir", str(tmp_path / "ckpt"), "--report", str(tmp_path / "report"), "--at", at, "--ranks", ranks, *extra)
    started = time.monotonic()
    run = run_script("preempt_early.py", *args, "--grace", str(grace), status=128 + signal.SIGTERM, timeout=200)
    assert "before the first training step" in run.stderr
    reports = read_reports(tmp_path / "report")
    signalled = [int(r) for r in ranks.split(",")]
    assert len(reports) >= len(signalled)  # a rank never signalled may have been ended by its launcher instead
    assert all(r["status"] == 128 + signal.SIGTERM and r["seconds"] < grace for r in reports), reports
    assert all(r["patched"] == [] for r in reports), reports  # every patched function is its original again
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())  # nothing written, whole or half
    assert time.monotonic() - started < 120  # not the 120 s each rank would have slept, nor a hang
    return run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("at", "ranks"),
    [
        ("setup", "0,1"),
        ("configure_model", "0,1"),
        ("patch", "0,1"),
        ("on_fit_start", "0,1"),
        ("fingerprint", "0,1"),
        ("sanity", "0"),
    ],
    ids=[
        "setup-every-rank",
        "load-every-rank",
        "patch-window-every-rank",
        "on-fit-start-every-rank",
        "fingerprint-every-rank",
        "sanity-rank0-only",
    ],
)
def test_a_sigterm_before_the_first_step_ends_every_rank_within_the_grace(tmp_path: Path, at: str, ranks: str) -> None:
    # every phase from the strategy's setup on; `train_dataloader` is the case below, in the same launch as its check
    _early_stop(tmp_path, at, ranks)


@pytest.mark.slow
def test_a_sigterm_in_train_dataloader_ends_every_rank_and_rank_0_last_with_the_stops_status(tmp_path: Path) -> None:
    # Lightning's observer of the launched ranks polls every 5 s and SIGKILLs the whole run, rank 0 included, once one
    # of them ended non-zero: a stop before the first step must take it off as a step-boundary stop does (one
    # campaign run in 3 ended rank 0 with -9 here, its teardown being slower than rank 1's). `--slow-exit` ends rank 0
    # 6 s after its report, after every check of the case above; one launch for both (a launch costs ~20 s)
    output = _early_stop(tmp_path, "train_dataloader", "0,1", "--slow-exit")
    assert "Forcefully terminating" not in output
    assert [r["status"] for r in read_reports(tmp_path / "report")] == [128 + signal.SIGTERM] * 2


@pytest.mark.slow
def test_a_load_that_outlasts_the_grace_after_a_sigterm_is_ended_by_the_watchdog(tmp_path: Path) -> None:
    # the load goes on for 120 s after the signal and no boundary comes: the watchdog ends each rank at its deadline
    grace = 5.0
    args = ["--dir", str(tmp_path / "ckpt"), "--report", str(tmp_path / "report"), "--at", "configure_model"]
    started = time.monotonic()
    run = run_script("preempt_early.py", *args, "--load", "120", "--grace", str(grace), status=143, timeout=200)
    assert f"the rank did not stop within {grace:g} s; exiting now with status 143" in run.stderr
    assert not (tmp_path / "report").exists() or not list((tmp_path / "report").iterdir())  # no rank went on
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())
    assert time.monotonic() - started < 100  # not the 120 s of the load
