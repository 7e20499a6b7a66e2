"""The CPU benchmark's comparison in bf16 on one CUDA GPU, where device memory shows. UNTESTED: written on a
machine without a GPU; nothing here has run on CUDA yet.

    python benchmarks/strategies/gpu.py      # one GPU; budgeted at about 6 minutes on an H200

Trains ``lora_stack_xl`` (537M frozen params, 1.07 GB in bf16; 2.1M trainable) on 1 process under (a)
``frozen_deepspeed``, (b) Lightning's ``deepspeed_stage_3_offload``, the ``lr=0`` workaround under both, and (d)
plain Lightning, each in its own process through ``worker.py`` (``--accelerator gpu --precision bf16-mixed``).
Besides the CPU figures, each run reports ``torch.cuda.max_memory_allocated`` during training, compared with
``estimate_memory``'s device bytes (which count Lightning's default 2e8-element gradient bucket: 381 MiB).
Writes ``results/gpu/`` (results.json, results.md, results.png). Exits with a message when CUDA is missing.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import records  # noqa: E402
from benchmarks.harness.probes import load_average  # noqa: E402
from benchmarks.strategies import report  # noqa: E402
from benchmarks.strategies.run import HERE, run_one, worker_env  # noqa: E402

MODEL = "lora_stack_xl"
GPU_CONFIGS = ("frozen", "stock", "stock_lr0", "frozen_lr0", "plain")
TIMEOUT_S = 240
WORKER_ARGS = ("--accelerator", "gpu", "--precision", "bf16-mixed")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/strategies/gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False here"
            f" (torch {torch.__version__}). The CPU benchmark is `python benchmarks/strategies/run.py`."
        )
    out = HERE / "results" / "gpu"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python benchmarks/strategies/gpu.py",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": torch.cuda.get_device_name(0),
        "setting": "1 CUDA GPU, bf16-mixed",
        "load_before": load_average(),
        "threads_per_process": "default",
    }
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="lightning-frozen-gpu-bench-"))
    env = worker_env(threads=None)
    try:
        runs = [run_one(MODEL, config, 1, scratch, logs, TIMEOUT_S, env, WORKER_ARGS) for config in GPU_CONFIGS]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta.update(load_after=load_average(), wall_s=round(time.perf_counter() - started, 1), versions=records.versions())
    results = {"meta": meta, "runs": runs}
    records.write_json(out / "results.json", results)
    report.write(results, out)
    print(f"wrote {out}/results.md, results.png, results.json in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
