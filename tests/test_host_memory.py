"""Host memory on the CPU accelerator: ZeRO-3's gather bounds sized to the model, and glibc returning freed memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_frozen import FrozenAwareDeepSpeedStrategy
from lightning_frozen.format import native_codec
from lightning_frozen.zero.compute import host_memory, quantized
from lightning_frozen.zero.params import full_param, gathered
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
    calls: list[str] = []
    monkeypatch.setattr(
        host_memory, "return_freed_memory", lambda: calls.append("set") or (lambda: calls.append("undone"))
    )
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(return_freed_memory=opted_in), max_steps=1)
    trainer.fit(AdapterModel(width=WIDTH), regression_data(width=WIDTH))
    assert calls == (["set", "undone"] if opted_in else [])  # the run's end puts the threshold back


_RETAINED = textwrap.dedent(
    """
    import sys, torch
    from lightning_frozen.zero.compute import host_memory

    def anon_mib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024

    print(host_memory.return_freed_memory() is not None if sys.argv[1] == "call" else False)
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


_UNDONE = textwrap.dedent(
    """
    import ctypes, torch
    from lightning_frozen.zero.compute import host_memory

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = type("MallInfo2", (ctypes.Structure,), {"_fields_": [(f, ctypes.c_size_t) for f in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]})
    undo = host_memory.return_freed_memory()
    undo()  # the end of the run: glibc's starting threshold (128 KiB) again
    before = libc.mallinfo2().hblks
    buffers = [torch.empty(512 << 10, dtype=torch.uint8).fill_(1) for _ in range(16)]
    print(libc.mallinfo2().hblks - before)  # of these, the chunks glibc mmapped
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_threshold_goes_back_when_the_run_ends() -> None:
    # under the run's 1 MiB threshold 512 KiB buffers come from the heap; with glibc's 128 KiB they are mmapped each,
    # but for the few that a free chunk already in the heap serves (it varies with what the imports freed)
    mmapped = {}
    for undo in ("undo()", "pass"):
        code = _UNDONE.replace("undo()  #", f"{undo}  #")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        mmapped[undo] = int(run.stdout.split()[-1])
    assert mmapped["undo()"] >= 12 and mmapped["pass"] <= 2, mmapped


def test_a_threshold_the_user_chose_is_kept() -> None:
    code = "from lightning_frozen.zero.compute import host_memory; print(host_memory.return_freed_memory() is not None)"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert run.stdout.split()[-1] == "False"


def _thp_mode() -> str:
    try:
        modes = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return modes.split("[")[1].split("]")[0]


def _huge_kib(tensor: torch.Tensor) -> tuple[int, bool]:
    """KiB of transparent huge pages in the mappings that overlap ``tensor``'s bytes, and whether one of them is
    advised to use them (``/proc/self/smaps``: ``hg`` in its ``VmFlags``; advice splits a mapping at the 2 MiB
    boundaries it names)."""
    first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    total, advised, overlaps = 0, False, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            overlaps = start < last and first < end
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1])
        elif overlaps and head == "VmFlags:":
            advised |= "hg" in line.split()[1:]
    return total, advised


def _huge_page_fallbacks() -> int:
    """How often this machine's kernel found no free 2 MiB page for a fault that asked for one (``/proc/vmstat``)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off or absent")
def test_a_gathers_fresh_buffers_are_backed_by_huge_pages() -> None:
    """The byte buffers a 2-rank gather writes the encoded base into, and decode's new outputs, ask for 2 MiB pages:
    the kernel zeroes 4 KiB ones about five times slower (``zero/compute/host_memory.py``)."""
    if native_codec.kernels() is None:
        pytest.skip("the advice is given by the compiled kernels, which need a C compiler")
    size = 32 << 20
    fallbacks = _huge_page_fallbacks()
    advised = [native_codec.empty_output((size,), torch.uint8), native_codec.empty_output((size // 4,), torch.float32)]
    plain = torch.empty(size, dtype=torch.uint8)
    for buffer in (*advised, plain):
        buffer.fill_(1)  # first touch: pages are chosen now
    assert [_huge_kib(buffer)[1] for buffer in (*advised, plain)] == [True, True, False]
    if _thp_mode() == "madvise":  # only advised memory gets huge pages: the advice made the difference
        assert _huge_kib(plain)[0] == 0
    lacking = [_huge_kib(buffer) for buffer in advised if _huge_kib(buffer)[0] < size // 2048]  # most: not the ends
    # the advice is a request: on a machine whose free memory is fragmented (other jobs' large models) the kernel
    # falls back to 4 KiB pages, and counts it machine-wide; it did in one of this suite's runs
    if lacking and (moved := _huge_page_fallbacks() - fallbacks):
        pytest.skip(f"huge pages not checked: the kernel fell back to 4 KiB pages {moved} times meanwhile ({lacking})")
    assert lacking == []


def test_decode_buffers_keep_an_unshared_tensor_of_a_repeated_size_for_the_next_of_that_size_within_budget() -> None:
    buffers = host_memory.DecodeBuffers()
    assert buffers.take(1000, torch.float32, asker=0) is None  # nothing kept yet
    buffers.give(torch.ones(1000))
    assert buffers.bytes_kept == 0  # one param of that size, like a model's embedding: not worth keeping
    for asker in range(1, host_memory.PARAMS_PER_SIZE_KEPT):
        buffers.take(1000, torch.float32, asker=asker)
    released = torch.ones(10, 100)  # what a released param held, in its shape
    pointer = released.data_ptr()
    buffers.give(released)
    del released
    assert buffers.bytes_kept == 4000
    assert buffers.take(1000, torch.bfloat16, asker=0) is None and buffers.take(999, torch.float32, asker=0) is None
    again = buffers.take(1000, torch.float32, asker=0)
    assert again is not None and again.data_ptr() == pointer and again.shape == (1000,)
    assert buffers.bytes_kept == 0 and buffers.take(1000, torch.float32, asker=0) is None

    shared = torch.ones(1000)
    saved = shared.t()  # what autograd keeps of a weight a layer read as a view
    buffers.give(shared)
    assert buffers.bytes_kept == 0  # a view of it lives on: written again, it would change what backward reads
    del saved

    # the budget: DECODE_BUDGET_MULTIPLE times the largest size kept (4000 bytes); the least recently kept go first
    kept = [torch.ones(1000) for _ in range(host_memory.DECODE_BUDGET_MULTIPLE + 1)]
    pointers = [t.data_ptr() for t in kept]
    while kept:
        buffers.give(kept.pop(0))
    assert buffers.bytes_kept == host_memory.DECODE_BUDGET_MULTIPLE * 4000
    taken = {buffers.take(1000, torch.float32, asker=0).data_ptr() for _ in range(2)}
    assert taken == set(pointers[1:])
    buffers.give(torch.ones(1000))
    buffers.close()  # the run ended: everything given back, nothing kept from now on
    assert buffers.bytes_kept == 0 and buffers.take(1000, torch.float32, asker=0) is None
    for asker in range(host_memory.PARAMS_PER_SIZE_KEPT):
        buffers.take(1000, torch.float32, asker=asker)
    buffers.give(torch.ones(1000))
    assert buffers.bytes_kept == 0


class ViewLinear(torch.nn.Linear):
    """A linear layer that multiplies by a view of its weight, which autograd saves for the backward pass (unlike
    ZeRO-3's own linear function, which saves the param and gathers it again)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


@pytest.mark.parametrize("layer", ["linear", "view of the weight"])
def test_an_nf4_fit_decodes_into_kept_buffers_and_trains_exactly_as_without(
    layer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each gather after the first decodes into a tensor a released param left, and training is unchanged to the bit,
    also where autograd saved a view of a released weight (that one is never handed out again)."""
    seen: dict[str, list[int]] = {}
    close = host_memory.DecodeBuffers.close

    def count_then_close(buffers: host_memory.DecodeBuffers) -> None:
        seen.setdefault("hits", []).append(buffers.hits)
        close(buffers)

    monkeypatch.setattr(host_memory.DecodeBuffers, "close", count_then_close)
    trained, default = {}, host_memory.DECODE_BUDGET_MULTIPLE
    for multiple in (default, 0):  # 0: nothing is kept, each decode is a new tensor
        monkeypatch.setattr(host_memory, "DECODE_BUDGET_MULTIPLE", multiple)
        model = AdapterModel(width=WIDTH, depth=3)
        if layer != "linear":
            for block in model.layers:
                block.base.__class__ = ViewLinear
        trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4"), max_steps=4, precision="32-true")
        trainer.fit(model, regression_data(width=WIDTH))
        assert trainer.strategy._compute.tables.buffers.bytes_kept == 0  # the run's, given back after it
        trained[multiple] = {n: full_param(p) for n, p in model.named_parameters() if p.requires_grad}
    kept_hits, fresh_hits = seen["hits"][-2:]
    assert fresh_hits == 0
    if layer == "linear":  # 4 steps x 3 layers x the bias, gathered for forward and for backward; the weights of
        assert kept_hits >= 4 * 3  # plain linear layers are decoded a few rows at a time (zero/compute/coded_linear.py)
    for name, value in trained[0].items():
        assert torch.equal(trained[default][name], value), name
    assert not torch.equal(trained[0]["layers.0.lora_b"], torch.zeros_like(trained[0]["layers.0.lora_b"]))


def test_a_released_weight_whose_view_lives_on_is_never_decoded_into() -> None:
    model = AdapterModel(width=WIDTH, depth=3)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4"), max_steps=1, precision="32-true")
    trainer.fit(model, regression_data(width=WIDTH))
    first, second, third = (layer.base.weight for layer in model.layers)
    tables = quantized.RunTables()  # the run's were closed at its end: these gathers keep decoded tensors again
    for weight in (first, second, third):
        quantized.install_quantized_gather(weight, tables)
    buffers = tables.buffers
    for other in (third, second):  # three params ask for the size
        with gathered(other):
            pass
    with gathered(first):
        transposed = first.data.t()  # a view that outlives the gather, as one autograd saved would
        expected = transposed.clone()
    with gathered(second):  # a new tensor: first's is still read through the view
        assert not torch.equal(second.data.t(), expected) and torch.equal(transposed, expected)
        pointer = second.data.data_ptr()
    assert buffers.bytes_kept == WIDTH * WIDTH * 4  # second's, kept once released
    with gathered(first):  # decoded into what second left
        assert first.data.data_ptr() == pointer and torch.equal(first.data.t(), expected)
    buffers.close()
