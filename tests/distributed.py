"""Run a test script under Lightning's own multi-process launcher, in a subprocess, with a time limit; or, for one
rank where a fresh process is not what is tested, in this process."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import runpy
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).parent / "scripts"
EXIT_HOOK = Path(__file__).parent / "exit_hook"  # its sitecustomize skips the collector's passes at a child's exit
RANK_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")


def own_extensions_dir() -> None:
    """Point ``TORCH_EXTENSIONS_DIR`` (unless set) at a folder of this interpreter's own, in which DeepSpeed's
    JIT-built CPU ops (its shared-memory collectives, which every rank builds or loads as ``deepspeed.comm`` starts,
    and CPU Adam) are built once and then only loaded.

    torch's default folder, ``~/.cache/torch_extensions/py311_cpu``, is one per Python and CUDA version, whatever torch
    built it: every venv of this machine (``.ci/run`` makes two, each with its torch) rebuilt the ops the one before
    it left, 22 to 58 s for the shared-memory op and 60 to 116 s for CPU Adam, measured from that folder's ninja log,
    inside whichever test started a rank first, while every other rank starting meanwhile waited on torch's lock
    file: the mT5 2-rank fit of ``scripts/seq2seq_two_rank.py`` took 31 s instead of 10, and 66 s instead of 19 beside
    two busy loops, on that first run only."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return
    import torch

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    folder = cache / "torch_extensions" / f"lightning-frozen-tests-{torch.__version__}-{key}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # torch's own default, as before
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)


def build_deepspeed_cpu_ops() -> float:
    """Build (or only load) DeepSpeed's CPU ops the tests use, in this process, before any test's time limit runs;
    the seconds it took. Nothing where torch sees a GPU (the CUDA accelerator builds its own)."""
    import torch

    if torch.cuda.is_available():
        return 0.0
    # lightning_frozen first: its import picks DeepSpeed's CPU accelerator without DeepSpeed's warning
    import lightning_frozen  # noqa: F401, I001
    from deepspeed.accelerator import get_accelerator

    begun = time.monotonic()
    for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)
    return time.monotonic() - begun


def fresh_env(**overrides: str) -> dict[str, str]:
    """This environment for a child process that starts a world of its own: without the rank variables an in-process
    Trainer left behind, on a free loopback port (one left behind may still be taken), with ``tests/exit_hook`` first
    on ``PYTHONPATH`` (a shutdown seconds shorter), then ``overrides``."""
    from lightning_frozen.process import rendezvous_port  # here: conftest imports this module before torch's setup

    environment = {key: value for key, value in os.environ.items() if key not in RANK_VARIABLES}
    python_path = os.pathsep.join(filter(None, [str(EXIT_HOOK), environment.get("PYTHONPATH")]))
    return {
        **environment,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(rendezvous_port()),
        "PYTHONPATH": python_path,
        **overrides,
    }


def run_script(
    name: str,
    *args: str,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    status: int = 0,
    prefix: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<name>`` with ``args`` (behind the command line ``prefix``, such as
    :func:`in_a_small_tmpfs`'s); fail with its output if it exits with another status than ``status`` or exceeds
    ``timeout`` seconds."""
    result = subprocess.run(
        [*prefix, sys.executable, str(SCRIPTS / name), *args],
        env=fresh_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != status:
        raise AssertionError(
            f"{name} {' '.join(args)} exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


def in_a_small_tmpfs(folder: Path, size: str) -> list[str] | None:
    """A command line prefix that runs a command in a mount namespace of its own, where ``folder`` (which exists) is
    a tmpfs of ``size`` (``mount``'s ``size=``: ``16k``); None where this machine cannot make one (``unshare -r``
    refused to a user other than root)."""
    namespace = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]  # root keeps its uids: chown works
    # sh -c 'script' folder command...: the script mounts "$0" and runs the command in "$@" in its place
    prefix = [*namespace, "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"', str(folder)]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if probe.returncode == 0 else None


def chained(*runs: Sequence[str]) -> list[str]:
    """One command line for several runs of a script in one world, each a Trainer of its own: ``runs`` joined by
    ``--then`` (the script splits them with :func:`runs_of`). Starting the ranks costs more than a small fit."""
    return [argument for index, run in enumerate(runs) for argument in (["--then"] if index else []) + list(run)]


def runs_of(arguments: Sequence[str]) -> list[list[str]]:
    """The runs of a command line :func:`chained` joined."""
    runs: list[list[str]] = [[]]
    for argument in arguments:
        if argument == "--then":
            runs.append([])
        else:
            runs[-1].append(argument)
    return runs


def run_in_this_process(name: str, *args: str) -> None:
    """Run ``tests/scripts/<name>`` with ``args`` in this process, on one rank: the imports a subprocess pays for
    at each start are paid once. The script must put back any global it patches; a fresh process is for what depends
    on one (several ranks, signals, memory per process, import-time behaviour)."""
    argv, path = sys.argv, list(sys.path)
    try:
        sys.argv = [str(SCRIPTS / name), *args]
        runpy.run_path(str(SCRIPTS / name), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path  # the scripts put the repository first on sys.path


class LoggedLines(logging.Handler):
    """The messages of the records it is given, from INFO up."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@contextmanager
def logged_lines() -> Iterator[LoggedLines]:
    """What Lightning's ``rank_zero_info`` / ``rank_zero_warn`` and this package's logger print inside the block."""
    handler = LoggedLines()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_frozen")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def write_report(folder: Path, rank: int, report: dict[str, Any]) -> None:
    """A script's findings on one rank, for :func:`read_reports` in the test that ran it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def read_reports(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]


def launch(
    script: str, *args: str, nodes: int = 1, timeout: float = 120, env: dict[str, str] | None = None
) -> tuple[list[int], list[str], float]:
    """Run ``tests/scripts/<script>`` with ``args`` in one process, which Lightning's launcher makes the ranks of one
    node, or as ``nodes`` simulated nodes of one process each (pass the script ``--devices=1 --num-nodes=<nodes>``),
    which find each other through Lightning's environment variables on loopback, so that each rank's exit status is
    its own process's. Returns the exit statuses, each process's output (stdout and stderr together) and the seconds
    until the last one ended; whatever runs past ``timeout`` is killed."""
    environment = fresh_env(OMP_NUM_THREADS="1", **(env or {}))
    if nodes > 1:
        environment["WORLD_SIZE"] = str(nodes)
    begun = time.monotonic()
    processes = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / script), *args],
            env={**environment, **({"NODE_RANK": str(node)} if nodes > 1 else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(nodes)
    ]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=max(1.0, timeout - (time.monotonic() - begun)))[0])
        except subprocess.TimeoutExpired:
            process.kill()
            outputs.append(process.communicate()[0] + f"\n<killed after {timeout:.0f} s>")
    return [p.returncode for p in processes], outputs, time.monotonic() - begun


def destroy_only_at_exit() -> None:
    """Put back the package's exit hook as it was before it waited for gloo's workers (it destroyed torch's default
    gloo group, nothing more): the "before" of ``tests/scripts/gloo_exit.py`` and ``benchmarks/exit``."""
    import atexit

    import torch.distributed as dist

    from lightning_frozen.zero.compute import gloo_exit

    def destroy_gloo_group() -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()

    gloo_exit.destroy_gloo_group_at_exit()  # registered once per process: a later setup adds no second hook
    atexit.unregister(gloo_exit.end_gloo_work)
    atexit.register(destroy_gloo_group)
