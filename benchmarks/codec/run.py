"""The frozen-storage codecs side by side, on one thread: ours (compiled kernels, and the tensor ops they replaced),
bitsandbytes', and the copy floor.

    python benchmarks/codec/run.py [--millions 16] [--repeats 7] [--out DIR]

For NF4 and int8, encode (fp32 weights in) and decode (into fp32 and into bf16), each in millions of weights per
second, median of ``--repeats`` calls on the same tensor of ``--millions`` M normal weights:

- ``kernels``: ``lightning_frozen.format.codec`` with its compiled CPU kernels (what training runs);
- ``tensor ops``: the same functions with the kernels switched off (the 0.1 codec, and the fallback without a C
  compiler); bit-identical output;
- ``bitsandbytes``: ``quantize_4bit`` / ``dequantize_4bit`` (NF4, block 64) and ``quantize_blockwise`` /
  ``dequantize_blockwise`` (block 256; its 8-bit format is a dynamic code map, not our absmax int8);
- floors: a bf16 -> fp32 cast of the same count into a fresh buffer (what a decode into a new tensor costs at
  least: the page faults of the new buffer plus one pass) and into a buffer already written (memory speed).

Every decode allocates its output, as a gather does, with glibc's mmap threshold fixed at 1 MiB as a fit sets it
(``return_freed_memory``): each output is fresh pages, so page faults count, as they do in training. On CUDA (if
present) the same rows run on the GPU, timed with ``torch.cuda.synchronize``. Writes ``<out>/codec.json`` and
``<out>/codec.md`` (``codec_gpu.*`` with CUDA).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness.probes import load_average  # noqa: E402
from benchmarks.harness.records import write_json  # noqa: E402
from lightning_frozen.format import codec, native_codec  # noqa: E402
from lightning_frozen.zero.compute.host_memory import return_freed_memory  # noqa: E402

GOALS = {"decode fp32": 1000.0, "encode": 300.0}  # M weights/s per core, issue 24


def rate(call: Callable[[], Any], count: int, repeats: int, device: torch.device) -> float:
    """Median millions of weights per second of ``call`` over ``repeats`` runs (one warm-up first)."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return count / statistics.median(times) / 1e6


def measure(count: int, repeats: int, device: torch.device) -> list[dict[str, Any]]:
    weights = (torch.randn(count, generator=torch.Generator().manual_seed(0)) * 0.02).to(device)
    rows: list[dict[str, Any]] = []

    def add(codec_name: str, fmt: str, operation: str, call: Callable[[], Any]) -> None:
        rows.append(
            {
                "device": device.type,
                "codec": codec_name,
                "format": fmt,
                "operation": operation,
                "m_per_s": round(rate(call, count, repeats, device), 1),
            }
        )

    cast = weights.bfloat16()
    warm = torch.empty(count, device=device)
    add("floor", "bf16 cast", "decode fp32 (fresh buffer)", lambda: torch.empty(count, device=device).copy_(cast))
    add("floor", "bf16 cast", "decode fp32 (written buffer)", lambda: warm.copy_(cast))
    if device.type == "cpu":  # the decoders' own output buffers ask for huge pages
        huge = native_codec.empty_output
        add("floor", "bf16 cast", "decode fp32 (fresh, huge pages)", lambda: huge((count,), torch.float32).copy_(cast))

    original_kernels = native_codec.kernels
    variants = [("kernels", original_kernels)] if device.type == "cpu" else [("ours (CUDA)", original_kernels)]
    if device.type == "cpu":
        variants.append(("tensor ops", lambda: None))
    for name, kernels in variants:
        native_codec.kernels = kernels
        try:
            for fmt in ("nf4", "int8"):
                stored = codec.encode(weights, fmt)
                add(name, fmt, "encode", lambda fmt=fmt: codec.encode(weights, fmt))
                for dtype, label in ((torch.float32, "decode fp32"), (torch.bfloat16, "decode bf16")):
                    add(name, fmt, label, lambda s=stored, f=fmt, d=dtype: codec.decode(s, count, f, d))
        finally:
            native_codec.kernels = original_kernels

    try:
        import bitsandbytes.functional as bnb
    except Exception as error:  # noqa: BLE001 - any import failure means: no bitsandbytes row
        rows.append({"device": device.type, "codec": "bitsandbytes", "error": f"{type(error).__name__}: {error}"})
        return rows
    for source, label in ((weights, "fp32"), (weights.bfloat16(), "bf16")):
        packed, state = bnb.quantize_4bit(source, blocksize=64, quant_type="nf4")
        if label == "fp32":
            add("bitsandbytes", "nf4", "encode", lambda s=source: bnb.quantize_4bit(s, blocksize=64, quant_type="nf4"))
        add("bitsandbytes", "nf4", f"decode {label}", lambda p=packed, q=state: bnb.dequantize_4bit(p, q))
        codes8, state8 = bnb.quantize_blockwise(source, blocksize=256)
        if label == "fp32":
            add("bitsandbytes", "8-bit map", "encode", lambda s=source: bnb.quantize_blockwise(s, blocksize=256))
        add("bitsandbytes", "8-bit map", f"decode {label}", lambda c=codes8, q=state8: bnb.dequantize_blockwise(c, q))
    return rows


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Frozen-storage codecs, one thread",
        "",
        f"{result['count']:,} weights, median of {result['repeats']} calls; {result['machine']};"
        f" load average {result['load_before']} before, {result['load_after']} after. M weights/s (higher is"
        " better); the ratio is to the fresh-buffer cast floor on the same device.",
        "",
        "| device | codec | format | operation | M weights/s | x floor |",
        "|---|---|---|---|---|---|",
    ]
    floors = {r["device"]: r["m_per_s"] for r in result["rows"] if r.get("operation") == "decode fp32 (fresh buffer)"}
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['device']} | {row['codec']} | - | - | {row['error']} | |")
            continue
        ratio = row["m_per_s"] / floors[row["device"]]
        lines.append(
            f"| {row['device']} | {row['codec']} | {row['format']} | {row['operation']} | {row['m_per_s']:,.0f}"
            f" | {ratio:.2f} |"
        )
    lines += ["", "Goals (issue 24, per core, CPU): decode into fp32 >= 1,000 M/s, encode >= 300 M/s.", ""]
    for row in result["rows"]:
        if row.get("device") == "cpu" and row.get("codec") == "kernels":
            goal = GOALS.get(row["operation"])
            if goal:
                verdict = "met" if row["m_per_s"] >= goal else "missed"
                lines.append(f"- {row['format']} {row['operation']}: {row['m_per_s']:,.0f} M/s, {verdict}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    freed = return_freed_memory()  # as a fit does: every decoded buffer is then fresh pages
    count = int(args.millions * 1e6) // 256 * 256
    load_before = load_average()[0]
    rows = measure(count, args.repeats, torch.device("cpu"))
    if torch.cuda.is_available():
        rows += measure(count, args.repeats, torch.device("cuda"))
    result = {
        "count": count,
        "repeats": args.repeats,
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "load_before": load_before,
        "load_after": load_average()[0],
        "mmap_threshold_1mib": freed,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "codec_gpu" if torch.cuda.is_available() else "codec"
    write_json(args.out / f"{name}.json", result)
    (args.out / f"{name}.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
