"""The one door to how frozen shards compute (zero/frozen_compute.py), chosen per device: the CPU's stack, or an
accelerator's, which sets nothing in the process and has nothing to undo."""

from __future__ import annotations

import torch
from torch import nn

from lightning_frozen.zero.compute import host_memory
from lightning_frozen.zero.frozen_compute import CpuFrozenCompute, FrozenCompute, frozen_compute_for


def test_the_cpu_gets_its_stack_and_an_accelerator_the_plain_compute() -> None:
    assert isinstance(frozen_compute_for(torch.device("cpu")), CpuFrozenCompute)
    cuda = frozen_compute_for(torch.device("cuda", 0))
    assert type(cuda) is FrozenCompute
    config: dict = {}
    assert cuda.bound_gathers(config, nn.Linear(4, 4)) == {} and config == {}
    assert cuda.set_process_memory() is None


def test_the_cpus_gather_bounds_and_end_of_run_go_through_the_door() -> None:
    compute = frozen_compute_for(torch.device("cpu"))
    config: dict = {"zero_optimization": {"stage": 3}}
    assert set(compute.bound_gathers(config, nn.Linear(4, 4))) == set(host_memory.GATHER_BOUNDS)
    buffers = host_memory.DECODE_BUFFERS
    for asker in range(host_memory.PARAMS_PER_SIZE_KEPT):
        buffers.take(1000, torch.float32, asker)
    buffers.give(torch.ones(1000))
    assert buffers.bytes_kept == 4000
    compute.end_run()
    assert buffers.bytes_kept == 0
