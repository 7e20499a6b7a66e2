"""Shared fixtures: Lightning's log lines, and a clean DeepSpeed accelerator for every test."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# bitsandbytes for the tests that compare with it, where scripts/bootstrap.sh puts it: beside the venv's packages, not
# in them, so that the main job's processes do not import it (before anything here imports transformers or PEFT)
TESTS_ONLY = Path(sys.prefix) / "tests-only"
if TESTS_ONLY.is_dir():
    sys.path.append(str(TESTS_ONLY))

from tests.distributed import LoggedLines, build_deepspeed_cpu_ops, logged_lines, own_extensions_dir  # noqa: E402

# one OpenMP thread per test process (pytest-xdist's workers and every process they start): two workers on two cores
# already fill the machine, and torch's idle OpenMP workers spin between ops, taking a core from the other worker
# (15% less CPU for the same in-process tests, measured). The tests of the OpenMP kernels ask for two themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_unconfigure(config: pytest.Config) -> None:
    codes = os.environ.get("LIGHTNING_FROZEN_CODE_CACHE", "")
    if not hasattr(config, "workerinput") and os.path.basename(codes).startswith("lightning-frozen-codes-"):
        shutil.rmtree(codes, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    # before pytest-xdist starts its workers, which, and every rank they start, inherit the folder and find the ops
    # built (see own_extensions_dir: a rebuild inside a 2-rank test tripled its time)
    own_extensions_dir()
    if not hasattr(config, "workerinput"):
        # the code cache of every fit the tests run, in a folder of this session's rather than the user's cache home
        os.environ.setdefault("LIGHTNING_FROZEN_CODE_CACHE", tempfile.mkdtemp(prefix="lightning-frozen-codes-"))
        seconds = build_deepspeed_cpu_ops()
        if seconds > 5:
            print(f"\nbuilt DeepSpeed's CPU ops in {os.environ.get('TORCH_EXTENSIONS_DIR')} ({seconds:.0f} s, once)")


@pytest.fixture
def lightning_log() -> Iterator[LoggedLines]:
    """What Lightning's ``rank_zero_info`` / ``rank_zero_warn`` and this package's logger printed during the test."""
    with logged_lines() as lines:
        yield lines


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two of torch's threads for the test, whatever ``OMP_NUM_THREADS`` the suite runs with: for the kernels that
    split their work over torch's OpenMP threads."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _cpu_deepspeed_accelerator() -> Iterator[None]:
    yield
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    if get_accelerator()._name != "cpu":
        set_accelerator(CPU_Accelerator())


# Files whose tests start several processes or run whole examples: last, so `pytest -x` reports the fast ones first.
_SLOW_FILES = ("test_examples.py", "test_reliability.py", "test_distributed.py", "test_peft_tuners.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name in _SLOW_FILES)  # a stable sort keeps each file's own order
