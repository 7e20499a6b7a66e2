"""LoRA on a 7B–13B Llama-2-shaped hub checkpoint on this CPU machine, end to end: load, train, save, resume.

    python benchmarks/big_model/run.py run --size 7b --frozen-dtype none --precision bf16-true --devices 1 2
    python benchmarks/big_model/run.py run --set issue          # the configurations of issue 17 (hours; see README)
    python benchmarks/big_model/run.py run --set check          # tiny model, 8 configurations, ~15 min on 2 cores
    python benchmarks/big_model/run.py run --dry-run --set issue   # what would run, and the arithmetic table
    python benchmarks/big_model/run.py write --size 13b         # only write the checkpoint folder
    python benchmarks/big_model/run.py check-writer             # from_pretrained (no DeepSpeed) on a tiny folder
    python benchmarks/big_model/run.py report                   # rewrite results/big_model.md from big_model.json

For each configuration the driver (this light process: no torch) makes sure the checkpoint folder is written
(``checkpoint.py``, once, reused), times a plain sequential read of its shard files, then starts the worker
(``worker.py``) in fresh processes under the harness's guard (``benchmarks/harness/launch.py``): a wall-clock timeout
and a memory guard (the sum of the run's processes' anonymous and shared memory, and the machine's available
memory) kill the whole process group and record ``timeout`` or ``exceeded``, so one configuration cannot take the
machine down. Every outcome, error included, is merged into ``results/big_model.json`` (one record per run, runs
accumulate) and ``results/big_model.md`` (the latest record of each configuration). ``report.py`` computes the
figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.big_model import report  # noqa: E402
from benchmarks.big_model.checkpoint import (  # noqa: E402
    OVERRIDES,
    SIZES,
    check_writer,
    complete,
    llama_config,
    shard_bytes_for,
    shard_files,
    size_key,
    write_checkpoint,
)
from benchmarks.harness.launch import child_env, guarded_run  # noqa: E402
from benchmarks.harness.probes import add_canary_option, load_average, machine, prepare_cache  # noqa: E402
from benchmarks.harness.records import git_commit, now_utc, read_rank_reports  # noqa: E402

DATA_DIR = Path("/work/bench-data")
FROZEN_DTYPES = ("none", "bf16", "int8", "nf4")  # "bf16": bf16 storage under fp32 compute, where the strategy has it
PRECISIONS = ("bf16-true", "32-true", "bf16-mixed")
# named sets: (size, frozen_dtype, precision, devices)
SETS: dict[str, list[tuple[str, str, str, int]]] = {
    "issue": [
        ("7b", "none", "bf16-true", 1),
        ("7b", "none", "bf16-true", 2),
        ("13b", "nf4", "bf16-true", 1),
        ("13b", "nf4", "bf16-true", 2),
        ("13b", "int8", "bf16-true", 1),
        ("13b", "int8", "bf16-true", 2),
    ],
    # bf16 against fp32 compute over each storage, 1 rank (the step is what differs); "bf16" storage under fp32
    # compute needs the strategy to accept frozen_dtype="bf16" (where it does not, the run records the refusal)
    "compute": [
        ("7b", storage, precision, 1)
        for storage, precision in (
            ("none", "bf16-true"),
            ("bf16", "32-true"),
            ("int8", "bf16-true"),
            ("int8", "32-true"),
            ("nf4", "bf16-true"),
            ("nf4", "32-true"),
        )
    ],
    "check": [
        ("tiny", storage, precision, devices)
        for storage in ("none", "nf4")
        for precision in ("bf16-true", "32-true")
        for devices in (1, 2)
    ],
}
# minutes per process group (training phase, then resume): generous, from a 469M model's times here scaled by
# parameters (x14 for 7B, x28 for 13B; quantizing, fingerprinting and bf16 steps take tens of minutes at that size)
TIMEOUT_MIN = {"tiny": 15, "1.1b": 30, "7b": 90, "13b": 180}
# ------------------------------------------------------------------------------------------------ one configuration


def config_key(
    size: str, overrides: dict[str, int], frozen_dtype: str, precision: str, devices: int, args: argparse.Namespace
) -> str:
    model = args.folder.name if args.folder else size_key(size, overrides)
    key = f"{model} {frozen_dtype} {precision} {devices}r seq{args.sequence}"
    key += f" {args.label}" if args.label else ""
    key += " mmap1m" if args.allocator == "mmap1m" else ""
    key += " exchange-codes" if args.exchange_codes else ""
    key += " experts-whole" if args.experts_whole else ""
    key += " gpu" if args.accelerator == "gpu" else ""
    key += f" canary-{'-'.join(args.canary)}" if args.canary != ["small"] else ""
    return key + (" decode-whole" if args.decode_whole else "")


def ensure_folder(size: str, overrides: dict[str, int], args: argparse.Namespace) -> Path:
    """The checkpoint folder of ``size`` with ``overrides`` under ``--data-dir``, written by a subprocess if needed
    (so this driver never holds torch or a shard)."""
    folder = args.data_dir / f"llama-{size_key(size, overrides)}"
    if complete(folder, llama_config(size, overrides), shard_bytes_for(size)):
        return folder
    command = [sys.executable, __file__, "write", "--size", size, "--data-dir", str(args.data_dir)]
    command += [f"--{key}={value}" for key, value in overrides.items()]
    subprocess.run(command, check=True, env=child_env())
    return folder


def run_config(size: str, frozen_dtype: str, precision: str, devices: int, args: argparse.Namespace) -> dict:
    """Run one configuration under the guard; return its record (status, figures, or the error)."""
    overrides = _overrides(args)
    key = config_key(size, overrides, frozen_dtype, precision, devices, args)
    print(f"\n=== {key}", flush=True)
    record: dict[str, Any] = {
        "key": key,
        "date": now_utc(),
        "commit": git_commit(),
        "load_average_at_start": load_average(),
        "machine": machine(),
        "config": dict(
            size=size,
            overrides=overrides,
            frozen_dtype=frozen_dtype,
            precision=precision,
            devices=devices,
            sequence=args.sequence,
            batch=args.batch,
            warmup=args.warmup,
            steps=args.steps,
            allocator=args.allocator,
            resume=not args.no_resume,
            folder=str(args.folder) if args.folder else None,
            lora=args.lora,
        ),
    }
    try:
        folder = args.folder or ensure_folder(size, overrides, args)
    except subprocess.CalledProcessError as error:  # recorded; the next configuration goes on
        record["outcome"] = {"status": "error", "reason": f"writing the checkpoint failed (exit {error.returncode})"}
        record["summary"] = report.summarize(record)
        return record
    files = shard_files(folder)
    record["checkpoint"] = {"folder": str(folder), "files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    record["cache"] = prepare_cache(files, args.cache)
    print(f"plain read: {record['cache']['plain_read']}", flush=True)
    run_dir = args.data_dir / "runs" / key.replace(" ", "_")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // devices)
    spec = dict(
        size=size,
        folder=str(folder),
        devices=devices,
        precision=precision,
        frozen_dtype=frozen_dtype,
        sequence=args.sequence,
        batch=args.batch,
        warmup=args.warmup,
        steps=args.steps,
        threads=threads,
        sample_s=args.sample_s,
        profile=args.profile,
        paired_floor=args.paired_floor,
        accelerator=args.accelerator,
        decode_whole=args.decode_whole,
        exchange_codes=args.exchange_codes,
        experts_whole=args.experts_whole,
        lora=args.lora,
        canary=args.canary,
    )
    env = child_env(threads=threads, mmap_1mib=args.allocator == "mmap1m" or None)
    files_of_run = dict(
        checkpoint=str(run_dir / "adapter.ckpt"),
        trained_adapter=str(run_dir / "trained_adapter.pt"),
        saved_step_file=str(run_dir / "saved_step.json"),
    )
    record["outcome"] = _phase(dict(spec, phase="train", **files_of_run), run_dir, env, args)
    record["ranks"] = read_rank_reports(run_dir)
    if args.no_resume:
        pass
    elif record["outcome"]["status"] == "ok" and Path(files_of_run["saved_step_file"]).exists():
        # a fresh process, as a resumed job is: a second Trainer in this one would keep the first one's base
        resume_dir = run_dir / "resume"
        record["resume_outcome"] = _phase(dict(spec, phase="resume", **files_of_run), resume_dir, env, args)
        resumed = {r["rank"]: r for r in read_rank_reports(resume_dir)}
        for rank in record["ranks"]:
            extra = resumed.get(rank["rank"], {})
            rank["errors"].update(extra.get("errors", {}))
            rank.update({k: v for k, v in extra.items() if k.startswith(("resume", "saved_step"))})
            if "running_peaks" in extra:
                rank["resume_running_peaks"] = extra["running_peaks"]
    else:
        record["resume_outcome"] = {"status": "not run", "reason": "the training phase did not save a checkpoint"}
    record["load_average_at_end"] = load_average()
    record["run_dir"] = str(run_dir)
    failed = [o for o in (record["outcome"], record.get("resume_outcome", {})) if o.get("status", "ok") != "ok"]
    if failed or any(r.get("errors") for r in record["ranks"]):
        record["log_tail"] = "".join(
            (d / "worker.log").read_text(errors="replace")[-3000:]
            for d in (run_dir, run_dir / "resume")
            if (d / "worker.log").exists()
        )
    record["summary"] = report.summarize(record)
    print(report.one_line(record), flush=True)
    return record


def _phase(spec: dict[str, Any], run_dir: Path, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """One guarded worker process group running ``spec``, from ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    command = [sys.executable, __file__, "--worker", str(run_dir / "spec.json")]
    timeout_min = args.timeout_min or TIMEOUT_MIN[spec["size"]]
    return guarded_run(
        command,
        env,
        run_dir / "worker.log",
        timeout_min,
        args.memory_limit_gib,
        args.min_available_gib,
        reports_dir=run_dir,
    )


def _overrides(args: argparse.Namespace) -> dict[str, int]:
    return {key: getattr(args, key) for key in OVERRIDES if getattr(args, key) is not None}


def _planned(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    if args.set:  # --size, given, replaces the set's sizes (e.g. the compute comparison on a smaller model)
        return [(args.size or size, *rest) for size, *rest in SETS[args.set]]
    return list(itertools.product([args.size or "tiny"], args.frozen_dtype, args.precision, args.devices))


def arithmetic_rows() -> list[dict[str, Any]]:
    """``report.arithmetic()``, computed in a subprocess: this driver stays free of torch."""
    command = [sys.executable, __file__, "--arithmetic"]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=child_env())
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> None:
    planned = _planned(args)
    done = report.done_keys(args.out) if args.skip_done else set()
    if args.dry_run:
        for size, frozen_dtype, precision, devices in planned:
            key = config_key(size, _overrides(args), frozen_dtype, precision, devices, args)
            folder = args.data_dir / f"llama-{size_key(size, _overrides(args))}"
            written = complete(folder, llama_config(size, _overrides(args)), shard_bytes_for(size))
            print(
                f"{key}{'  (done, skipped)' if key in done else ''}: {folder} {'complete' if written else 'to write'},"
                f" timeout {args.timeout_min or TIMEOUT_MIN[size]} min per process group"
            )
        print("\n" + report.arithmetic_markdown(report.arithmetic()))
        return
    for size, frozen_dtype, precision, devices in planned:
        if config_key(size, _overrides(args), frozen_dtype, precision, devices, args) in done:
            continue
        record = run_config(size, frozen_dtype, precision, devices, args)
        report.merge(record, args.out, arithmetic_rows)  # after each one: a long set keeps what it has measured


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":  # the worker, and rank 1 started by Lightning's launcher
        from benchmarks.big_model.worker import run as run_worker  # here only: the driver holds no torch

        run_worker(Path(sys.argv[2]))
        return
    if sys.argv[1:] == ["--arithmetic"]:
        print(json.dumps(report.arithmetic()))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run configurations and merge their results")
    write_parser = commands.add_parser("write", help="write (or reuse) the checkpoint folder of --size")
    commands.add_parser("check-writer", help="from_pretrained on a tiny folder: no missing/unexpected keys")
    report_parser = commands.add_parser("report", help="rewrite big_model.md from big_model.json")
    for sub in (run_parser, write_parser):
        sub.add_argument("--size", choices=[s for s in SIZES if s != "70b"], help="default: tiny, or the set's")
        for key, field in OVERRIDES.items():
            sub.add_argument(f"--{key}", type=int, help=f"override {field}")
        sub.add_argument("--data-dir", type=Path, default=DATA_DIR, help="checkpoint folders and run directories")
    for sub in (run_parser, report_parser):
        sub.add_argument("--out", type=Path, default=HERE / "results", help="where big_model.{json,md} go")
    run_parser.add_argument("--set", choices=list(SETS), help="a named set of configurations (ignores --size ...)")
    run_parser.add_argument("--frozen-dtype", nargs="+", choices=FROZEN_DTYPES, default=["none"])
    run_parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["bf16-true"])
    run_parser.add_argument("--devices", nargs="+", type=int, default=[1])
    run_parser.add_argument("--sequence", type=int, default=64, help="tokens per sequence")
    run_parser.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    run_parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    run_parser.add_argument("--steps", type=int, default=2, help="timed steps")
    run_parser.add_argument("--threads", type=int, help="torch threads per rank (default: cores / devices)")
    run_parser.add_argument(
        "--timeout-min",
        type=float,
        help=f"wall-clock limit of each process group (train, resume): default {TIMEOUT_MIN}",
    )
    run_parser.add_argument(
        "--memory-limit-gib",
        type=float,
        default=21,
        help="kill a run whose processes hold more anonymous + shared memory than this",
    )
    run_parser.add_argument(
        "--min-available-gib",
        type=float,
        default=1.0,
        help="kill a run when the machine's MemAvailable falls below this",
    )
    run_parser.add_argument(
        "--cache",
        choices=("cold", "warm"),
        default="cold",
        help="evict the shard files before the plain read and before the run, or read warm",
    )
    run_parser.add_argument(
        "--allocator",
        choices=("default", "mmap1m"),
        default="default",
        help="glibc as a user runs it, or MALLOC_MMAP_THRESHOLD_=1MiB (RSS follows live memory)",
    )
    run_parser.add_argument("--sample-s", type=float, default=0.1, help="each rank's memory sampling interval")
    run_parser.add_argument("--no-resume", action="store_true", help="stop after the save (no second load)")
    run_parser.add_argument("--profile", action="store_true", help="profile the last timed step (step_profile.py)")
    run_parser.add_argument(
        "--accelerator",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: one CUDA device per rank, the frozen shards in CPU memory (scripts/gpu_check.sh)",
    )
    run_parser.add_argument(
        "--paired-floor",
        action="store_true",
        help="time the dense-matmul floor after every step after the first, in each rank (step_profile.py paired)",
    )
    run_parser.add_argument(
        "--decode-whole",
        action="store_true",
        help="the alternative to zero/compute/coded_linear.py: frozen linear weights decoded whole at each gather",
    )
    run_parser.add_argument(
        "--exchange-codes",
        action="store_true",
        help="the alternative to zero/frozen_files.py: ranks exchange frozen codes through gloo at each gather",
    )
    run_parser.add_argument(
        "--experts-whole",
        action="store_true",
        help="the alternative to zero/compute/coded_experts.py: a MoE layer's fused experts decoded whole per gather",
    )
    run_parser.add_argument(
        "--folder",
        type=Path,
        help="train on this Hugging Face folder instead of the written Llama (its name keys the run)",
    )
    run_parser.add_argument(
        "--lora",
        type=json.loads,
        help="LoraConfig arguments as JSON (default: r=8 on q_proj/v_proj), e.g. '{\"r\": 4, ...}'",
    )
    add_canary_option(run_parser)
    run_parser.add_argument("--label", help="a word added to the configuration's key (e.g. which LoRA it trains)")
    run_parser.add_argument("--skip-done", action="store_true", help="skip configurations with a successful record")
    run_parser.add_argument("--dry-run", action="store_true", help="list the configurations and the arithmetic")
    args = parser.parse_args()
    if args.command == "write":
        args.size = args.size or "tiny"
        folder = args.data_dir / f"llama-{size_key(args.size, _overrides(args))}"
        write_checkpoint(folder, llama_config(args.size, _overrides(args)), shard_bytes_for(args.size))
    elif args.command == "check-writer":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="big_model_writer_") as scratch:
            problems = check_writer(Path(scratch) / "tiny")
        print("writer check: " + ("; ".join(problems) if problems else "from_pretrained loads every key, values equal"))
        raise SystemExit(1 if problems else 0)
    elif args.command == "report":
        report.write_markdown(args.out)
        print((args.out / "big_model.md").read_text())
    else:
        run(args)


if __name__ == "__main__":
    main()
