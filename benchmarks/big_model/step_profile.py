"""Where one training step's time goes, each part beside its floor measured in the same process.

    python benchmarks/big_model/step_profile.py run --size 1.1b --frozen-dtype nf4 --devices 1 2   # run.py, profiled
    python benchmarks/big_model/step_profile.py report --append "2026-12-03, ..."       # add to step_profile.md
    python benchmarks/big_model/step_profile.py floor --key "7b bf16 32-true 2r seq64"  # a recorded floor again
    python benchmarks/big_model/step_profile.py paired --size 7b --frozen-dtype bf16  # each step beside its floor

``run`` starts ``run.py run ... --profile`` (fp32 compute, 64 tokens per rank, LoRA r=8 q/v): its worker adds
:class:`StepProfile`, which profiles the last timed step of each rank with ``torch.profiler`` and splits its wall
time into:

- **forward / backward / optimizer**: from the step's start to Lightning's ``on_before_backward``, to
  ``on_after_backward``, to the step's end (the optimizer step, ZeRO's reduce and the rest);
- **matmuls** in forward and in backward (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``; attention's fused kernel);
- **decode**: the frozen shards' dequantization (``codec.decode`` inside the quantized gather, and
  ``partial_decode.decode_range`` or a ``range_decoder``'s calls: a linear layer's or an expert's weight decoded a few
  rows at a time beside its matmuls);
- **gather wait**: the quantized gather's wait less its decode (the collective, 2 ranks);
- **ZeRO-3 hooks**: DeepSpeed's ``fetch_sub_module`` / ``release_sub_module`` less the gather and decode in them;
- **other**: the rest (Python, autograd, elementwise ops, allocation).

Floors, in the same process after the fit: the **dense matmuls** (every profiled matmul run again with its own
shapes on dense fp32 tensors already in memory; a linear layer computed from its codes a few rows at a time,
``zero/compute/coded_linear.py``, counts as the one whole matmul a dense model runs for it, its weight read from memory:
timing its row tiles again would time them in cache, a floor no dense model reaches; that figure is kept beside it),
the **decode** at the codec's own rate (``codec.decode`` of the same format on 16M weights into a buffer written
before, as a gather decodes into a released param's; before 2026-12-02 05:00 UTC into fresh buffers; before
2026-12-06 09:00 UTC with the tensor-op codec, not the compiled kernels a run uses) and its bytes (codes read, fp32
values written) at a copy's rate, the decode's physical limit, and the
**gather** at a copy's rate (the bytes gathered at ``torch.Tensor.copy_`` speed). Figures go into each rank's report
(``profile``) and ``results/step_profile.md``.

``floor`` times the dense-matmul floor again from the shapes of the latest profiled run of ``--key``, each rank's in
a process of its own (1 torch thread each), all ranks at once as in a run, ``--rounds`` times: for a run whose
profiled step cannot finish (at 7B the profiler's records took more memory than the machine had left), compared with
that configuration's unprofiled steps. The shapes depend on the model and the tokens only.

``paired`` needs no profiler, so it fits where a profiled step does not: ``run.py --paired-floor`` records the matmul
shapes of the warm-up step with a dispatch mode that keeps one count per shape (:class:`PairedFloor`), then after
every timed step each rank times their dense floor, all ranks at once, before the next step starts. Each step is
set beside a floor read seconds after it, in the same processes: on a machine whose memory bandwidth moves with its
neighbours, a floor read minutes away can differ by 1.7x. Its table goes to ``results/paired_floor_runs`` and, with
``--append``, to ``step_profile.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from benchmarks.harness.records import read_json  # noqa: E402

MATMULS = (
    "aten::mm",
    "aten::addmm",
    "aten::addmm_",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
)
PHASES = ("forward", "backward", "optimizer")
DECODE, GATHER, HOOKS = "lf.decode", "lf.gather_wait", "lf.zero_hooks"
DECODE_ROWS = "lf.decode_rows"  # in a layer's forward or backward, outside the gather
CODED = "lf.coded_matmul"  # a linear layer's matmul computed from its codes, row tile by row tile
DENSE, DECODE_FLOOR, GATHER_FLOOR = "dense matmuls", "decode at the codec's rate", "gather at a copy's rate"
DECODE_AT_COPY = "decode's bytes at a copy's rate"  # codes read + fp32 values written: the decode's physical limit
FLOOR_TIMINGS = 5  # a shape's floor is the median of this many calls (three calls' mean before 2026-12-03 15:15 UTC)
TILES_IN_CACHE = "dense matmuls of the row tiles, in cache"  # the floor as measured before 2026-12-03 14:20 UTC


def _callback_base() -> type:
    from lightning.pytorch.callbacks import Callback

    return Callback


@contextmanager
def _labelled(
    owner: Any, attribute: str, label: str, count: Any = None, static: bool = False, depth: Any = None
) -> Iterator[None]:
    """While active, every call of ``owner.attribute`` runs inside ``record_function(label)``; ``count`` is told
    each call's arguments and result. ``static``: the attribute is a staticmethod of the class ``owner``. ``depth``
    (a one-item list) is raised by one while a call runs."""
    import torch

    original = getattr(owner, attribute)
    restored = owner.__dict__[attribute] if static else original
    depth = [0] if depth is None else depth

    def labelled(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        try:
            with torch.profiler.record_function(label):
                result = original(*args, **kwargs)
        finally:
            depth[0] -= 1
        if count is not None:
            count(args, result)
        return result

    setattr(owner, attribute, staticmethod(labelled) if static else labelled)
    try:
        yield
    finally:
        setattr(owner, attribute, restored)


@contextmanager
def _labelled_range_decoders(count: Any) -> Iterator[None]:
    """While active, each function ``partial_decode.range_decoder`` returns (a gathered weight's tiles decoded one
    kernel call each, bypassing ``decode_range``) runs its calls inside ``record_function(DECODE_ROWS)``, each counted
    as :func:`_labelled` counts (a range it hands to ``decode_range`` is counted there too: rare, a shard's edge)."""
    import torch

    from lightning_frozen.format import partial_decode

    original = getattr(partial_decode, "range_decoder", None)
    if original is None:  # a package from before 2026-12-06: every tile went through decode_range
        yield
        return

    def range_decoder(*args: Any) -> Any:
        decode = original(*args)

        def labelled(start: int, out: Any) -> Any:
            with torch.profiler.record_function(DECODE_ROWS):
                result = decode(start, out)
            count((start, out), result)
            return result

        return labelled

    partial_decode.range_decoder = range_decoder
    try:
        yield
    finally:
        partial_decode.range_decoder = original


class StepProfile(_callback_base()):  # type: ignore[misc]
    """Profiles the step ``profile_step`` (0-based, of this fit) and keeps its breakdown in ``self.result``."""

    def __init__(self, profile_step: int) -> None:
        super().__init__()
        self.profile_step = profile_step
        self.result: dict[str, Any] = {}
        self.marks: dict[str, float] = {}
        self._profiler: Any = None
        self._patches: Any = None
        self._step = 0
        self.decoded_weights = self.gathered_bytes = 0
        self.coded_shapes: dict[str, int] = defaultdict(int)  # the whole matmuls of layers computed from codes

    def _count_decoded(self, args: Any, result: Any) -> None:
        self.decoded_weights += result.numel()

    def _count_gathered(self, args: Any, result: Any) -> None:
        self.gathered_bytes += args[0].numel() * args[0].element_size()

    def _now(self) -> float:
        return time.perf_counter()

    def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
        if self._step != self.profile_step:
            return
        import contextlib

        import deepspeed.comm
        import deepspeed.comm.comm
        import torch
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        from lightning_frozen.format import partial_decode
        from lightning_frozen.zero.compute import quantized

        self._patches = contextlib.ExitStack()
        _count_coded(self._patches, self.coded_shapes)
        self._patches.enter_context(_labelled(quantized, "decode", DECODE, self._count_decoded))
        self._patches.enter_context(_labelled(partial_decode, "decode_range", DECODE_ROWS, self._count_decoded))
        self._patches.enter_context(_labelled_range_decoders(self._count_decoded))
        for owner in (deepspeed.comm, deepspeed.comm.comm):  # DeepSpeed's own gathers call the latter
            self._patches.enter_context(
                _labelled(owner, "all_gather_into_tensor", "lf.all_gather", self._count_gathered)
            )
        self._patches.enter_context(_labelled(quantized._GatherHandle, "wait", GATHER))
        for hook in ("fetch_sub_module", "release_sub_module"):
            self._patches.enter_context(_labelled(PartitionedParameterCoordinator, hook, HOOKS))
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self._profiler.__enter__()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self.marks = {"start": self._now()}

    def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
        if self._profiler is not None:
            self.marks["backward"] = self._now()

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        if self._profiler is not None:
            self.marks["optimizer"] = self._now()

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self._step += 1
        if self._profiler is None:
            return
        self.marks["end"] = self._now()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._profiler.__exit__(None, None, None)
        self._patches.close()
        self.result = breakdown(self._profiler, self.marks, self.coded_shapes)
        self.result["process"] = {  # the whole process over the step, its other threads included
            "user_s": round(usage.ru_utime - self._usage.ru_utime, 2),
            "system_s": round(usage.ru_stime - self._usage.ru_stime, 2),
            "minor_faults": usage.ru_minflt - self._usage.ru_minflt,
            "involuntary_switches": usage.ru_nivcsw - self._usage.ru_nivcsw,
        }
        self.result["top_self_s"] = {
            e.key: round(e.self_cpu_time_total / 1e6, 2)
            for e in sorted(self._profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        }
        self._profiler = None


def _count_coded(patches: Any, counts: dict[str, int], depth: Any = None) -> None:
    """Into the ExitStack ``patches``: each forward and backward of a layer computed from its codes
    (``zero/compute/coded_linear.py``) labelled :data:`CODED` and counted in ``counts`` as the one whole matmul a
    dense model runs for it (the backward only where it computes the input's gradient); ``depth`` as
    :func:`_labelled` keeps it."""
    from lightning_frozen.zero.compute import coded_linear

    def forward(args: Any, result: Any) -> None:
        _, input, weight = args[:3]
        out_features, in_features = weight.ds_shape[-2:]
        rows = input.numel() // in_features
        counts[json.dumps(["aten::mm", [[rows, in_features], [in_features, out_features]]])] += 1

    def backward(args: Any, result: Any) -> None:
        ctx, grad_output = args[:2]
        out_features, in_features = ctx.weight.ds_shape[-2:]
        if result[0] is not None:
            rows = grad_output.numel() // out_features
            counts[json.dumps(["aten::mm", [[rows, out_features], [out_features, in_features]]])] += 1

    coded = coded_linear.CodedMatmul
    patches.enter_context(_labelled(coded, "forward", CODED, forward, static=True, depth=depth))
    patches.enter_context(_labelled(coded, "backward", CODED, backward, static=True, depth=depth))


def _matmul_counter(counts: dict[str, int], inside_coded: list[int]) -> Any:
    """A dispatch mode that counts every matmul of :data:`MATMULS` by its input shapes, as the profiler records them
    (``[]`` for an argument that is not a tensor), except those run inside a layer computed from its codes
    (``inside_coded[0] > 0``): those count as their whole matmul instead. It keeps one count per shape, where the
    profiler keeps a record of every op: at 7B, with 2 MiB tiles, the profiler's records outgrew the machine."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulShapes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func._schema.name
            if name in MATMULS and not inside_coded[0]:
                shapes = [list(a.shape) if isinstance(a, torch.Tensor) else [] for a in args]
                counts[json.dumps([name, shapes])] += 1
            return func(*args, **(kwargs or {}))

    return MatmulShapes()


class PairedFloor(_callback_base()):  # type: ignore[misc]
    """The dense-matmul floor beside every step of the same run: records the matmul shapes of step ``record_step``
    (a warm-up step: the counting slows it) without ``torch.profiler``, then at the end of every later step times
    their dense floor (:func:`_dense_matmuls`) in this process, between that step and the next. Each step has a floor
    read minutes, not hours, from it, by the same process under the same neighbours. The floor's operands (up to a
    dense lm_head's fp32 weight) raise the rank's memory while it runs: read no memory figure from such a run."""

    def __init__(self, record_step: int = 0) -> None:
        super().__init__()
        self.record_step = record_step
        self.shapes: dict[str, int] = defaultdict(int)
        self.coded_shapes: dict[str, int] = defaultdict(int)
        self.floor_s: list[float] = []  # one per step after record_step
        self._inside_coded = [0]
        self._patches: Any = None
        self._step = 0

    def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
        if self._step != self.record_step:
            return
        import contextlib

        self._patches = contextlib.ExitStack()
        _count_coded(self._patches, self.coded_shapes, self._inside_coded)
        self._patches.enter_context(_matmul_counter(self.shapes, self._inside_coded))

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        step, self._step = self._step, self._step + 1
        if self._patches is not None:
            self._patches.close()
            self._patches = None
        elif step > self.record_step:
            self.floor_s.append(round(_dense_matmuls(self.shapes) + _dense_matmuls(self.coded_shapes), 3))

    def result(self) -> dict[str, Any]:
        return {
            "record_step": self.record_step,
            "floor_s": self.floor_s,  # after steps record_step + 1, record_step + 2, ...
            "matmul_shapes": dict(self.shapes),
            "coded_shapes": dict(self.coded_shapes),
        }


def breakdown(profiler: Any, marks: dict[str, float], coded_shapes: dict[str, int]) -> dict[str, Any]:
    """Seconds per part of the profiled step (see the module docstring), and what the floors need: the shapes of
    the matmuls, a coded layer's as its whole matmul (``coded_shapes``), and apart its row tiles'."""
    events = profiler.events()
    start_us = min(e.time_range.start for e in events) if events else 0
    # the profiler's clock and perf_counter differ by an offset: align on the step's start
    bounds_us = {p: (marks[p] - marks["start"]) * 1e6 + start_us for p in ("backward", "optimizer", "end")}

    def phase_of(event: Any) -> str:
        if event.time_range.start < bounds_us["backward"]:
            return "forward"
        return "backward" if event.time_range.start < bounds_us["optimizer"] else "optimizer"

    seconds: dict[str, float] = defaultdict(float)
    shapes: dict[str, int] = defaultdict(int)
    tile_shapes: dict[str, int] = defaultdict(int)
    for event in events:
        total = event.cpu_time_total / 1e6
        if event.name in MATMULS:
            seconds[f"matmul {phase_of(event)}"] += total
            in_coded = _inside(event, CODED)
            (tile_shapes if in_coded else shapes)[json.dumps([event.name, event.input_shapes])] += 1
        elif event.name == DECODE:
            seconds["decode"] += total
        elif event.name == DECODE_ROWS:
            seconds["decode in layers"] += total
        elif event.name == GATHER:
            seconds["gather wait (with decode)"] += total
        elif event.name == HOOKS:
            seconds["ZeRO-3 hooks (with gather)"] += total
    wall = {
        "forward": marks["backward"] - marks["start"],
        "backward": marks["optimizer"] - marks["backward"],
        "optimizer": marks["end"] - marks["optimizer"],
    }
    gather = max(0.0, seconds.pop("gather wait (with decode)", 0.0) - seconds["decode"])
    hooks = max(0.0, seconds.pop("ZeRO-3 hooks (with gather)", 0.0) - gather - seconds["decode"])
    parts = {
        "matmul forward": seconds["matmul forward"],
        "matmul backward": seconds["matmul backward"],
        "decode": seconds["decode"] + seconds["decode in layers"],
        "gather wait": gather,
        "ZeRO-3 hooks": hooks,
    }
    parts["optimizer and reduce"] = wall["optimizer"] - seconds["matmul optimizer"]
    parts["other"] = sum(wall.values()) - sum(parts.values())
    return {
        "step_s": sum(wall.values()),
        "wall": wall,
        "parts": parts,
        "matmul_shapes": dict(shapes),  # outside layers computed from codes
        "coded_shapes": dict(coded_shapes),  # those layers' matmuls, whole
        "tile_shapes": dict(tile_shapes),  # and as they ran, row tile by row tile
    }


def _inside(event: Any, label: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == label:
            return True
        parent = parent.cpu_parent
    return False


def _dense_matmuls(counts: dict[str, int]) -> float:
    """Seconds for each of ``counts`` (``[op, input shapes]`` as JSON: times run), run on dense fp32 tensors: the
    median of :data:`FLOOR_TIMINGS` calls after a first one, times its count."""
    import torch

    matmul = 0.0
    for key, count in counts.items():
        name, shapes = json.loads(key)
        operands = [torch.randn(shape) if shape else None for shape in shapes]
        call = {
            "aten::mm": lambda a, b, *_: torch.mm(a, b),
            "aten::addmm": lambda c, a, b, *_: torch.addmm(c, a, b),
            "aten::addmm_": lambda c, a, b, *_: c.addmm_(a, b),
            "aten::bmm": lambda a, b, *_: torch.bmm(a, b),
            "aten::baddbmm": lambda c, a, b, *_: torch.baddbmm(c, a, b),
        }.get(name)
        if call is None or any(
            o is None for o in operands[: 3 if name in ("aten::addmm", "aten::addmm_", "aten::baddbmm") else 2]
        ):
            continue
        call(*operands)
        timings = []
        for _ in range(FLOOR_TIMINGS):
            started = time.perf_counter()
            call(*operands)
            timings.append(time.perf_counter() - started)
        matmul += statistics.median(timings) * count
    return matmul


def floors(result: dict[str, Any], frozen_dtype: str, decoded_weights: int, gathered_bytes: int) -> dict[str, float]:
    """The floor of each part, measured here: dense matmuls of the profiled shapes, the codec, a copy."""
    import torch

    from lightning_frozen.format import codec, native_codec

    plain = _dense_matmuls(result["matmul_shapes"])
    out = {DENSE: plain + _dense_matmuls(result.get("coded_shapes", {}))}
    if result.get("tile_shapes"):
        out[TILES_IN_CACHE] = plain + _dense_matmuls(result["tile_shapes"])
    copy_rate = _copy_rate() if gathered_bytes or decoded_weights else 0.0
    if frozen_dtype not in ("none", None) and decoded_weights:
        # the compiled kernels where they built, as a run decodes (before 2026-12-06 09:00 UTC: the tensor-op codec)
        kernels = native_codec.KERNELS if native_codec.kernels() is not None else None
        sample = codec.encode(torch.randn(1 << 24) * 0.02, frozen_dtype, kernels=kernels)
        written = codec.decode(sample, 1 << 24, frozen_dtype, torch.float32, kernels=kernels)
        started = time.perf_counter()
        for _ in range(3):
            codec.decode(sample, 1 << 24, frozen_dtype, torch.float32, out=written, kernels=kernels)
        rate = 3 * (1 << 24) / (time.perf_counter() - started)
        out[DECODE_FLOOR] = decoded_weights / rate
        out["codec M/s"] = rate / 1e6
        out["kernels"] = kernels is not None
        # its physical limit: the codes read and the fp32 values written, at a copy's rate
        moved = decoded_weights * (codec.block_format(frozen_dtype).stored_bytes(1 << 24) / (1 << 24) + 4)
        out[DECODE_AT_COPY] = moved / copy_rate
        out["decoded weights"] = decoded_weights
        out["copy GB/s"] = copy_rate / 1e9
    if gathered_bytes:
        out[GATHER_FLOOR] = gathered_bytes / copy_rate
    return out


def _copy_rate() -> float:
    """Bytes a second of ``torch.Tensor.copy_`` between two 64 MiB buffers written before (each byte read once and
    written once), in this process."""
    import torch

    source, target = torch.empty(1 << 26, dtype=torch.uint8), torch.empty(1 << 26, dtype=torch.uint8)
    target.copy_(source)
    started = time.perf_counter()
    for _ in range(3):
        target.copy_(source)
    return 3 * (1 << 26) / (time.perf_counter() - started)


# ------------------------------------------------------------------------------------------------ driver and report


def report(records: list[dict[str, Any]]) -> str:
    lines = [
        "# Where a step's time goes",
        "",
        "Written by `benchmarks/big_model/step_profile.py` from `run.py --profile` runs: the last timed step of each"
        " rank, profiled (`torch.profiler`, which slows a step by a few percent, and by up to a fifth where layers"
        " compute from their codes in many small matmuls), in seconds, worst rank. Floors are measured in the same"
        " process after the fit. fp32 compute, 64 tokens per rank.",
        "",
        "| config | date, commit | load avg | step s | fwd | bwd | opt | matmul fwd | matmul bwd | dense matmul floor"
        " | ÷ floor | decode | at codec rate | gather wait | at copy rate | ZeRO-3 hooks | optimizer+reduce | other"
        " | dense floor of the row tiles, in cache |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        ranks = [r for r in record.get("ranks", []) if r.get("profile")]
        if not ranks:
            continue
        worst = max(ranks, key=lambda r: r["profile"]["step_s"])
        profile, parts, floor = worst["profile"], worst["profile"]["parts"], worst.get("profile_floors", {})
        dense = floor.get(DENSE)
        cells = [
            record["key"],
            f"{record['date']}, {record['commit']}",
            str(record["load_average_at_start"][0]),
            f"{profile['step_s']:.2f}",
            *(f"{profile['wall'][p]:.2f}" for p in PHASES),
            f"{parts['matmul forward']:.2f}",
            f"{parts['matmul backward']:.2f}",
            "" if dense is None else f"{dense:.2f}",
            "" if not dense else f"{profile['step_s'] / dense:.1f}",
            f"{parts['decode']:.2f}",
            f"{floor.get(DECODE_FLOOR, 0):.2f}",
            f"{parts['gather wait']:.2f}",
            f"{floor.get(GATHER_FLOOR, 0):.2f}",
            f"{parts['ZeRO-3 hooks']:.2f}",
            f"{parts['optimizer and reduce']:.2f}",
            f"{parts['other']:.2f}",
            "" if TILES_IN_CACHE not in floor else f"{floor[TILES_IN_CACHE]:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "÷ floor: the whole step over the same matmuls on dense weights (issue 24's goal at 13B NF4: ≤ 2.0). A layer"
        " computed from its codes counts as its one whole matmul, its dense weight read from memory as a dense model"
        " reads it; the last column times its row tiles instead, each again on a tile already in cache, as this"
        " floor was measured before 2026-12-03 14:20 UTC.",
        "",
    ]
    return "\n".join(lines)


def paired_report(record: dict[str, Any]) -> str:
    """A ``paired`` run's table: each step after the first beside the dense floors its ranks timed right after it."""
    ranks = [r for r in record.get("ranks", []) if r.get("paired_floor", {}).get("floor_s")]
    if not ranks:
        return f"{record['key']}: no paired floor recorded ({record.get('outcome', {}).get('reason', 'no ranks')})"
    first = ranks[0]["paired_floor"]["record_step"] + 1
    count = min(len(r["paired_floor"]["floor_s"]) for r in ranks)
    lines = [
        f"`{record['key']}`, {record['date']}, {record['commit']}, load average {record['load_average_at_start'][0]}"
        f" at the start. Step {first - 1} recorded the matmul shapes (and is not counted); after each later step every"
        " rank timed their dense floor, all ranks at once.",
        "",
        "| step | step s (slowest rank) | dense floor s, each rank | step ÷ mean floor |",
        "|---|---|---|---|",
    ]
    ratios = []
    for i in range(count):
        step = max(r["step_s"][first + i] for r in ranks)
        floor = [r["paired_floor"]["floor_s"][i] for r in ranks]
        ratios.append(step / statistics.mean(floor))
        lines.append(f"| {first + i} | {step:.2f} | {', '.join(f'{f:.2f}' for f in floor)} | {ratios[-1]:.2f} |")
    lines += ["", f"Median ratio {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})."]
    return "\n".join(lines)


def _floor_again(args: argparse.Namespace, runs: Path) -> None:
    """``floor``: the dense-matmul floor of ``args.key``'s latest profiled run, timed again (see the module's doc)."""
    profiled = [r for r in read_json(runs / "big_model.json")["records"] if r["key"] == args.key]
    profiled = [r for r in profiled if all(rank.get("profile", {}).get("matmul_shapes") for rank in r["ranks"])]
    if not profiled:
        raise SystemExit(f"no profiled run of {args.key!r} in {runs / 'big_model.json'}")
    record = profiled[-1]
    if args.rank is not None:
        import torch

        torch.set_num_threads(1)
        profile = record["ranks"][args.rank]["profile"]
        print(json.dumps(_dense_matmuls(profile["matmul_shapes"]) + _dense_matmuls(profile.get("coded_shapes", {}))))
        return
    ranks = range(len(record["ranks"]))
    print(f"{args.key}: the shapes of the profiled run of {record['date']}; seconds per rank, all ranks at once")
    readings = []
    for round_ in range(args.rounds):
        command = [sys.executable, __file__, "floor", "--key", args.key, "--out", str(args.out), "--rank"]
        workers = [subprocess.Popen([*command, str(rank)], stdout=subprocess.PIPE, text=True) for rank in ranks]
        seconds = [float(worker.communicate()[0].strip().splitlines()[-1]) for worker in workers]
        readings += seconds
        print(f"round {round_ + 1}: " + ", ".join(f"{value:.1f}" for value in seconds))
    print(f"all readings: median {statistics.median(readings):.1f} s, {min(readings):.1f}-{max(readings):.1f} s")


def _paired(args: argparse.Namespace) -> None:
    """``paired``: run.py with ``--paired-floor`` (no profiler), then its table (see :class:`PairedFloor`)."""
    runs = args.out / "paired_floor_runs"
    command = [sys.executable, str(HERE / "run.py"), "run", "--size", args.size, "--precision", "32-true"]
    command += ["--frozen-dtype", args.frozen_dtype, "--devices", args.devices, "--steps", str(args.steps)]
    command += ["--warmup", "1", "--no-resume", "--paired-floor", "--data-dir", str(args.data_dir), "--out", str(runs)]
    subprocess.run(command, check=False)
    table = paired_report(read_json(runs / "big_model.json")["records"][-1])
    print(table)
    if args.append:
        with open(args.out / "step_profile.md", "a") as file:
            file.write(f"\n## {args.append}\n\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--size", default="1.1b")
    run_parser.add_argument("--frozen-dtype", nargs="+", default=["nf4"])
    run_parser.add_argument("--devices", nargs="+", default=["1", "2"])
    run_parser.add_argument("--steps", type=int, default=2)
    run_parser.add_argument("--data-dir", type=Path, default=Path("/work/bench-data"))
    run_parser.add_argument("--decode-whole", action="store_true", help="see run.py --decode-whole")
    run_parser.add_argument("--exchange-codes", action="store_true", help="see run.py --exchange-codes")
    report_parser = commands.add_parser("report")
    report_parser.add_argument(
        "--append",
        metavar="HEADING",
        help="add the table under this heading to step_profile.md (its earlier sections are kept as they are)",
    )
    floor_parser = commands.add_parser("floor")
    floor_parser.add_argument("--key", required=True, help='a profiled configuration, e.g. "7b bf16 32-true 2r seq64"')
    floor_parser.add_argument("--rounds", type=int, default=4)
    floor_parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a worker: that rank's floor, as JSON
    paired_parser = commands.add_parser("paired")
    paired_parser.add_argument("--size", default="7b")
    paired_parser.add_argument("--frozen-dtype", default="bf16")
    paired_parser.add_argument("--devices", default="2")
    paired_parser.add_argument("--steps", type=int, default=4)
    paired_parser.add_argument("--data-dir", type=Path, default=Path("/work/bench-data"))
    paired_parser.add_argument("--append", metavar="HEADING", help="add the table to step_profile.md under this")
    for sub in (run_parser, report_parser, floor_parser, paired_parser):
        sub.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    runs = args.out / "step_profile_runs"
    if args.command == "floor":
        _floor_again(args, runs)
        return
    if args.command == "paired":
        _paired(args)
        return
    if args.command == "run":
        command = [
            sys.executable,
            str(HERE / "run.py"),
            "run",
            "--size",
            args.size,
            "--precision",
            "32-true",
            "--frozen-dtype",
            *args.frozen_dtype,
            "--devices",
            *args.devices,
            "--steps",
            str(args.steps),
            "--warmup",
            "1",
            "--no-resume",
            "--profile",
            "--data-dir",
            str(args.data_dir),
            "--out",
            str(runs),
            *(["--decode-whole"] if args.decode_whole else []),
            *(["--exchange-codes"] if args.exchange_codes else []),
        ]
        subprocess.run(command, check=False)
    records = read_json(runs / "big_model.json")["records"]
    table = report(list({r["key"]: r for r in records}.values()))
    print(table)
    if args.command == "report" and args.append:
        body = table.split("\n", 2)[2]  # the table without the file's title
        with open(args.out / "step_profile.md", "a") as file:
            file.write(f"\n## {args.append}\n\n{body}")


if __name__ == "__main__":
    main()
