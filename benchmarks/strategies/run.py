"""Run the benchmark: every model x configuration x process count, each in a fresh process; write ``results/``.

    python benchmarks/strategies/run.py            # 2 models x 6 configurations x 1 and 2 processes
    python benchmarks/strategies/run.py --quick    # 1 process only

Each configuration runs ``worker.py`` in its own process group under the harness's guard (2 processes: Lightning's
launcher starts rank 1), one at a time; checkpoints go to a scratch folder that is deleted afterwards. Writes
``results.json`` (raw figures), ``results.md`` and ``results.png`` (through ``report.py``), and each run's log under
``results/logs/``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import launch, records  # noqa: E402
from benchmarks.harness.probes import load_average  # noqa: E402
from benchmarks.strategies import report  # noqa: E402
from benchmarks.strategies.configs import CONFIGS, CPU_DEVICES, CPU_MODELS  # noqa: E402

HERE = Path(__file__).resolve().parent


def worker_env(threads: Optional[int]) -> dict[str, str]:
    """The environment of every worker: torch threads per process (None: torch's default), and glibc's malloc
    mapping every buffer above 1 MiB, so that RSS follows live memory (``worker.keep_buffers_in_heap``)."""
    return launch.child_env(threads=threads, mmap_1mib=True)


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
    outcome = launch.guarded_run(command, env, logs / f"{name}.log", timeout_s / 60, reports_dir=out_dir)
    returncode = launch.exit_status(outcome)
    ranks = records.read_rank_reports(out_dir)
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
        "command": " ".join(["python", "benchmarks/strategies/run.py", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": records.host(),
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
    meta.update(load_after=load_average(), wall_s=round(time.perf_counter() - started, 1), versions=records.versions())
    results = {"meta": meta, "runs": runs}
    records.write_json(args.out / "results.json", results)
    report.write(results, args.out)
    print(f"wrote {args.out}/results.md, results.png, results.json in {meta['wall_s']} s")


if __name__ == "__main__":
    main()
