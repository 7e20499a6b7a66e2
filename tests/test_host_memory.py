"""Host memory on the CPU accelerator: ZeRO-3's gather bounds sized to the model, and glibc returning freed memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.zero import host_memory
from tests.models import AdapterModel, cpu_trainer, regression_data

WIDTH = 64
LARGEST = WIDTH * WIDTH + WIDTH  # one LoRALinear's frozen `base` Linear: the most elements a module holds itself
BOUNDS = ("prefetch_bucket_size", "max_reuse_distance", "max_live_parameters")


def test_unset_bounds_become_multiples_of_the_largest_module_and_set_ones_stay() -> None:
    model = AdapterModel(width=WIDTH, depth=3)
    config: dict = {}
    applied = host_memory.bound_gathers_on_cpu(config, model)
    expected = {"stage3_prefetch_bucket_size": LARGEST, "stage3_max_reuse_distance": 0}
    expected["stage3_max_live_parameters"] = LARGEST
    assert applied == expected and config["zero_optimization"] == expected
    user = {"zero_optimization": {"stage3_max_live_parameters": 10**9, "max_reuse_distance": 10**9}}
    assert host_memory.bound_gathers_on_cpu(user, model) == {"stage3_prefetch_bucket_size": LARGEST}
    assert user["zero_optimization"]["stage3_max_live_parameters"] == 10**9
    assert "stage3_max_reuse_distance" not in user["zero_optimization"]  # set under its bare name: left alone


def _engine_bounds(trainer: Any) -> dict[str, int]:
    engine = trainer.strategy.model
    return {name: int(getattr(engine, f"zero_{name}")()) for name in BOUNDS}


def test_a_cpu_fit_bounds_the_gathers_unless_the_config_sets_them() -> None:
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), max_steps=2)
    trainer.fit(AdapterModel(width=WIDTH), regression_data(width=WIDTH))
    assert _engine_bounds(trainer) == {
        "prefetch_bucket_size": LARGEST,
        "max_reuse_distance": 0,
        "max_live_parameters": LARGEST,
    }
    config = {
        "zero_optimization": {"stage": 3, **{f"stage3_{name}": 10**9 for name in BOUNDS}},
        "train_micro_batch_size_per_gpu": 8,
    }
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(config=config), max_steps=2)
    trainer.fit(AdapterModel(width=WIDTH), regression_data(width=WIDTH))
    assert _engine_bounds(trainer) == {name: 10**9 for name in BOUNDS}


@pytest.mark.parametrize("opted_in", [True, False])
def test_the_strategy_sets_the_allocator_on_the_cpu_unless_told_not_to(
    opted_in: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(host_memory, "return_freed_memory", lambda: calls.append(True) or True)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(return_freed_memory=opted_in), max_steps=1)
    trainer.fit(AdapterModel(width=WIDTH), regression_data(width=WIDTH))
    assert calls == ([True] if opted_in else [])


_RETAINED = textwrap.dedent(
    """
    import sys, torch
    from lightning_frozen.zero import host_memory

    def anon_mib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024

    print(host_memory.return_freed_memory() if sys.argv[1] == "call" else False)
    torch.empty(4 << 20, dtype=torch.uint8).fill_(1)  # freed: glibc raises its mmap threshold above 4 MiB
    before = anon_mib()
    buffers = [torch.empty(2 << 20, dtype=torch.uint8).fill_(1) for _ in range(64)]
    del buffers[:-1]  # 126 MiB freed below the one still alive, so the heap cannot shrink from the top
    print(anon_mib() - before)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_buffers_leave_the_process_once_the_allocator_is_set() -> None:
    held = {}
    for mode in ("call", "skip"):
        run = subprocess.run([sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, check=True)
        did, mib = run.stdout.split()
        held[mode] = (did, float(mib))
    assert held["call"][0] == "True" and held["skip"][0] == "False"
    assert held["skip"][1] > 100  # glibc's default keeps the freed 2 MiB buffers
    assert held["call"][1] < 10, held  # with the threshold at 1 MiB only the live buffer is held


def test_a_threshold_the_user_chose_is_kept() -> None:
    code = "from lightning_frozen.zero import host_memory; print(host_memory.return_freed_memory())"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert run.stdout.split()[-1] == "False"
