"""Run the benchmark: every model x configuration x process count, each in a fresh process; write ``results/``.

    python benchmarks/run.py            # 2 models x 6 configurations x 1 and 2 processes
    python benchmarks/run.py --quick    # 1 process only

Each configuration runs ``worker.py`` in its own subprocess (2 processes: Lightning's launcher starts rank 1),
one at a time; checkpoints go to a scratch folder that is deleted afterwards. Writes ``results.json`` (raw
figures), ``results.md`` and ``results.png`` (through ``report.py``), and each run's log under ``results/logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import report  # noqa: E402
from benchmarks.configs import CONFIGS, CPU_DEVICES, CPU_MODELS  # noqa: E402

HERE = Path(__file__).resolve().parent


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def worker_env(threads: Optional[int]) -> dict[str, str]:
    """The environment of every worker: torch threads per process (None: torch's default), and glibc's malloc
    mapping every buffer above 1 MiB, so that RSS follows live memory (``worker.keep_buffers_in_heap``)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1024 * 1024)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_one(
    model: str,
    config: str,
    devices: int,
    scratch: Path,
    logs: Path,
    timeout_s: float,
    env: dict[str, str],
    worker_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run ``worker.py`` for one configuration in a fresh process and return its ranks' figures."""
    name = f"{model}-{config}-{devices}p"
    out_dir = scratch / name
    out_dir.mkdir(parents=True)
    command = [sys.executable, str(HERE / "worker.py"), model, config, str(devices), str(out_dir), *worker_args]
    started = time.perf_counter()
    load_before = load_average()
    with open(logs / f"{name}.log", "w") as log:
        # a session of its own, so a hung rank is stopped with its launcher on timeout
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = "timeout"
    ranks = [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]
    shutil.rmtree(out_dir)
    record = {
        "model": model,
        "config": config,
        "devices": devices,
        "returncode": returncode,
        "wall_s": round(time.perf_counter() - started, 1),
        "load_before": load_before,
        "ranks": ranks,
    }
    print(f"{name}: exit {returncode} in {record['wall_s']} s", flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 process only")
    parser.add_argument("--models", nargs="+", default=list(CPU_MODELS), choices=CPU_MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    # one thread per process by default: on a shared 2-core machine, OpenMP threads that wait on each other make
    # step times swing by 10x whenever another process takes a core
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS)")
    args = parser.parse_args()

    devices = (1,) if args.quick else CPU_DEVICES
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["python", "benchmarks/run.py", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "setting": "CPU (DeepSpeed's CPU accelerator, gloo), fp32",
        "load_before": load_average(),
        "threads_per_process": args.threads,
    }
    env = worker_env(args.threads)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="lightning-frozen-bench-"))
    try:
        runs = [
            run_one(model, config, n, scratch, logs, args.timeout, env)
            for model in args.models
            for n in devices
            for config in args.configs
        ]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta.update(load_after=load_average(), wall_s=round(time.perf_counter() - started, 1), versions=versions())
    results = {"meta": meta, "runs": runs}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    report.write(results, args.out)
    print(f"wrote {args.out}/results.md, results.png, results.json in {meta['wall_s']} s")


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "lightning", "deepspeed", "peft", "transformers")}


if __name__ == "__main__":
    main()
