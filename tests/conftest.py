"""Shared fixtures: Lightning's log lines, and a clean DeepSpeed accelerator for every test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.distributed import LoggedLines, logged_lines

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def lightning_log() -> Iterator[LoggedLines]:
    """What Lightning's ``rank_zero_info`` / ``rank_zero_warn`` and this package's logger printed during the test."""
    with logged_lines() as lines:
        yield lines


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
