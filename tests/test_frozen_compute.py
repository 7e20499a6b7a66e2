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
    buffers = compute.tables.buffers
    for asker in range(host_memory.PARAMS_PER_SIZE_KEPT):
        buffers.take(1000, torch.float32, asker)
    buffers.give(torch.ones(1000))
    assert buffers.bytes_kept == 4000
    compute.end_run()
    assert buffers.bytes_kept == 0


def test_two_computes_in_one_process_share_no_table() -> None:
    """Two strategies (or two runs) each make their own compute: one's decode buffers, coded layers and tile buffers
    are not the other's, and one's end of run leaves the other's as they are."""
    first, second = frozen_compute_for(torch.device("cpu")), frozen_compute_for(torch.device("cpu"))
    assert first.tables.buffers is not second.tables.buffers and first.tables.layers is not second.tables.layers
    for compute in (first, second):
        for asker in range(host_memory.PARAMS_PER_SIZE_KEPT):
            compute.tables.buffers.take(1000, torch.float32, asker)
        compute.tables.buffers.give(torch.ones(1000))
    first.end_run()
    assert first.tables.buffers.bytes_kept == 0 and second.tables.buffers.bytes_kept == 4000
    assert second.tables.buffers.take(1000, torch.float32, asker=0) is not None
    assert first.tables.buffers.take(1000, torch.float32, asker=0) is None  # ended: keeps and gives nothing
