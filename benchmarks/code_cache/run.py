"""The frozen base from disk (issue 61): the code cache's second fit, a base larger than memory, a 70B
pre-quantized folder and a Qwen3-30B-A3B-shaped MoE base, each beside its baseline in one run, on this CPU.

    python benchmarks/code_cache/run.py --bench fit13b             # 13B nf4: first fit (cache cold) vs second fits
    python benchmarks/code_cache/run.py --bench larger             # a base whose cache file is >= 1.5x the memory left
    python benchmarks/code_cache/run.py --bench 70b [--layers-70b N]   # Llama-2-70B-shaped bnb nf4 folder, 2 steps
    python benchmarks/code_cache/run.py --bench moe [--layers-moe N]   # Qwen3-30B-A3B's layer shapes, nf4
    python benchmarks/code_cache/run.py --bench fit13b larger 70b moe --tiny --out /tmp/cc_trial   # the plumbing
    python benchmarks/code_cache/run.py report                     # rewrite results/code_cache.md from the json
    python benchmarks/code_cache/run.py clean                      # remove this study's folders and caches

Heavy: run it under ``flock /tmp/lf-multi.lock`` on the shared machine. Every fit is one fresh process (1 rank unless
``--devices``) under ``benchmarks/harness/launch.py``'s guard, with ``FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4",
code_cache=<data-dir>/code_cache/<bench>)`` (where the strategy has no ``code_cache`` argument yet, nothing is passed
and the record says so), ``from_pretrained`` + PEFT LoRA (r=8, q/v) in ``configure_model``, ``32-true``, 64 random
tokens a step. ``worker.py`` says what a fit records; ``folders.py`` writes the 70B and MoE folders; the 13B folder is
``benchmarks/big_model/run.py write --size 13b``'s (run through its command line).

- ``fit13b``: the 13B folder evicted from the page cache (``posix_fadvise(DONTNEED)`` per file; the benchmark runs as
  root here, but ``drop_caches`` would empty the whole shared machine's cache, so it is not used), then fit 1 (no cache
  file: folder read and encoded, the file written), fit 2 (the file as fit 1 left it in the page cache) and fit 3 (the
  file evicted first: read from disk), each to its first step (``--steps`` 1: that step runs too); with ``--off``,
  a fit with ``code_cache=False`` first, today's path without the write.
- ``larger``: the 13B cache file (made by a fit if missing). Fit A, in memory: the file read into the page cache
  first, ``--steps`` 3. Then a balloon process (``run.py balloon``: anonymous memory allocated, touched and
  ``mlock``-ed, ``oom_score_adj`` 1000 so that the kernel kills it first) takes all but ``file / --ratio`` of the
  machine's available memory; the disk's read rate is measured with the balloon up (the folder's shards evicted, then
  read sequentially), the file is evicted, and fit B runs the same steps. Per step: the time, the bytes read from
  storage (``/proc/<pid>/io`` ``read_bytes``) and those bytes at the measured rate. The driver releases the balloon at
  once if the machine's available memory falls under ``--balloon-floor-gib``.
- ``70b``: the pre-quantized folder (``--layers-70b``, default: as many layers as folder + cache fit the disk's free
  space less ``--reserve-gib``), fit 1 (the folder transcoded, the file written) with ``--steps`` 2, no balloon; then,
  with ``--second``, a fit from the file.
- ``moe``: the bf16 folder (``--layers-moe``, default from the free disk likewise), nf4, LoRA on q/v: fit 1 (encode +
  write) and fit 2 (from the file), ``--steps`` 2 each.

Results: ``<out>/code_cache.json`` (every record, appended) and ``<out>/code_cache.md`` (the tables).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.harness.launch import child_env, guarded_run  # noqa: E402
from benchmarks.harness.probes import (  # noqa: E402
    available_bytes,
    cpu_model,
    evict,
    load_average,
    machine,
    meminfo_bytes,
    plain_read,
    resident_bytes,
)
from benchmarks.harness.records import (  # noqa: E402
    append_record,
    git_commit,
    now_utc,
    read_json,
    read_rank_reports,
    versions,
    write_json,
)

BIG_MODEL = HERE.parent / "big_model" / "run.py"
DATA_DIR = Path("/work/bench-data")
TESTS_ONLY = HERE.parents[1] / ".venv" / "tests-only"  # bitsandbytes, for the 70B folder's writer and users' loads
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
GIB = 2**30
CACHE_NF4_PER_WEIGHT = 0.53125  # the package's NF4: 0.5 B a weight + an fp16 scale a block of 64
TINY_LLAMA = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
TINY_MOE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    vocab_size=1000,
)


# ------------------------------------------------------------------------------------------------ one fit


def fit(
    name: str,
    bench: str,
    folder: Path,
    cache: Optional[Any],
    args: argparse.Namespace,
    steps: int,
    min_available_gib: float = 1.0,
    note: str = "",
) -> dict[str, Any]:
    """One fit in a fresh guarded process; its record (outcome and rank 0's figures)."""
    run_dir = args.data_dir / "runs" / "code_cache" / f"{bench}-{name}".replace(" ", "_")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = dict(
        folder=str(folder),
        frozen_dtype="nf4",
        code_cache=cache,
        cache_dir=cache if isinstance(cache, str) else None,
        lora=LORA,
        steps=steps,
        sequence=64,
        devices=args.devices,
        precision="32-true",
        threads=max(1, (os.cpu_count() or 1) // args.devices),
    )
    write_json(run_dir / "spec.json", spec)
    env = child_env(threads=spec["threads"])
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(TESTS_ONLY)])
    print(f"--- {bench}: {name} ({note or 'fit'}), available {available_bytes() / GIB:.1f} GiB", flush=True)
    outcome = guarded_run(
        [sys.executable, __file__, "--worker", str(run_dir / "spec.json")],
        env,
        run_dir / "worker.log",
        args.timeout_min,
        args.memory_limit_gib,
        min_available_gib,
        reports_dir=run_dir,
    )
    ranks = read_rank_reports(run_dir)
    record = {"name": name, "note": note, "outcome": outcome, "rank0": ranks[0] if ranks else {}, "ranks": len(ranks)}
    if outcome["status"] != "ok" or not ranks or ranks[0].get("errors"):
        record["log_tail"] = (run_dir / "worker.log").read_text(errors="replace")[-4000:]
    print(one_line(record), flush=True)
    return record


def one_line(record: dict[str, Any]) -> str:
    rank = record["rank0"]
    steps = [s["s"] for s in rank.get("steps", [])]
    peaks = {**rank.get("load_peaks", {}), **{}}
    train = rank.get("train_peaks") or rank.get("train_peaks_so_far") or {}
    anon = max(peaks.get("anon", 0), train.get("anon", 0))
    return (
        f"    {record['name']}: {record['outcome']['status']}, first step at {rank.get('first_step_at')} s, steps"
        f" {steps}, anon peak {anon / GIB:.2f} GiB, errors {list(rank.get('errors', {}))}"
    )


def cache_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


def codes_files(cache: Path) -> list[Path]:
    return [p for p in cache_files(cache) if p.name.endswith(".codes")]


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("model*.safetensors"))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in shard_files(folder))


# ------------------------------------------------------------------------------------------------ folders


def llama13b_folder(args: argparse.Namespace) -> Path:
    size = "tiny" if args.tiny else "13b"
    subprocess.run(
        [sys.executable, str(BIG_MODEL), "write", "--size", size, "--data-dir", str(args.data_dir)],
        check=True,
        env=child_env(),
    )
    return args.data_dir / f"llama-{size}"


def write_in_subprocess(kind: str, folder: Path, layers: int, args: argparse.Namespace) -> None:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(TESTS_ONLY)])
    command = [sys.executable, __file__, "write", kind, str(folder), str(layers)] + (["--tiny"] if args.tiny else [])
    subprocess.run(command, check=True, env=env)


def layers_that_fit(per_layer: float, fixed: float, args: argparse.Namespace, most: int) -> int:
    """Decoder layers whose folder and cache fit the free disk less ``--reserve-gib``."""
    free = shutil.disk_usage(args.data_dir).free - args.reserve_gib * GIB
    return max(1, min(most, int((free - fixed) // per_layer)))


# ------------------------------------------------------------------------------------------------ the benchmarks


def bench_fit13b(args: argparse.Namespace) -> dict[str, Any]:
    folder = llama13b_folder(args)
    cache = args.data_dir / "code_cache" / "llama13b"
    shutil.rmtree(cache, ignore_errors=True)
    result: dict[str, Any] = {"bench": "fit13b", "folder": str(folder), "folder_bytes": folder_bytes(folder)}
    steps = 1 if args.steps is None else args.steps  # 0: each fit stops where its first step would start
    fits = []
    if args.off:
        result["evict_before_off"] = evict(shard_files(folder))
        fits.append(fit("off", "fit13b", folder, False, args, steps, note="code_cache=False, folder cold"))
    result["evict_before_first"] = evict(shard_files(folder))
    fits.append(fit("first", "fit13b", folder, str(cache), args, steps, note="no cache file, folder cold"))
    files = codes_files(cache)
    result["cache_files"] = {str(p.relative_to(cache)): p.stat().st_size for p in cache_files(cache)}
    result["cache_resident_before_second"] = resident_bytes(files) if files else None
    fits.append(fit("second", "fit13b", folder, str(cache), args, steps, note="cache file in page cache"))
    if files:
        result["evict_before_third"] = evict(files)
    fits.append(fit("third", "fit13b", folder, str(cache), args, steps, note="cache file evicted first"))
    result["fits"] = fits
    return result


class Balloon:
    """A process holding ``size`` bytes of locked anonymous memory (``run.py balloon``) until :meth:`release`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.process = subprocess.Popen(
            [sys.executable, __file__, "balloon", str(size)], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self.report = json.loads(self.process.stdout.readline() or "{}")  # once it holds it all

    def alive(self) -> bool:
        return self.process.poll() is None

    def release(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        self.process.wait()


def balloon_main(size: int) -> None:
    """Allocate ``size`` bytes, touch every page, lock them where allowed; report; wait to be killed."""
    with open("/proc/self/oom_score_adj", "w") as adj:
        adj.write("1000")  # if memory runs out anyway, the kernel kills this first
    began = time.perf_counter()
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    chunk = b"\1" * (64 * 2**20)
    for offset in range(0, size, len(chunk)):
        region[offset : offset + len(chunk)] = chunk[: size - offset]
    locked = False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        address = ctypes.c_void_p.from_buffer(region)
        locked = libc.mlock(ctypes.addressof(address), ctypes.c_size_t(size)) == 0
        del address
    except Exception:
        locked = False
    with open("/proc/self/status") as lines:
        status = {k: v for k, v in (line.split(":", 1) for line in lines) if k in ("RssAnon", "VmLck")}
    print(
        json.dumps(
            {
                "bytes": size,
                "locked": locked,
                "s": round(time.perf_counter() - began, 1),
                **{k: v.strip() for k, v in status.items()},
            }
        ),
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        signal.pause()


def disk_rate(paths: list[Path], most_bytes: int) -> dict[str, Any]:
    """Sequential read rate of ``paths`` (up to ``most_bytes``), evicted first: the disk's own pace."""
    chosen, total = [], 0
    for path in paths:
        if total >= most_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    evicted = evict(chosen)
    return {"files": [p.name for p in chosen], "evicted": evicted, **plain_read(chosen)}


def bench_larger(args: argparse.Namespace) -> dict[str, Any]:
    folder = llama13b_folder(args)
    cache = args.data_dir / "code_cache" / "llama13b"
    result: dict[str, Any] = {"bench": "larger", "folder": str(folder), "ratio_asked": args.ratio}
    fits = []
    if not codes_files(cache):
        fits.append(fit("make", "larger", folder, str(cache), args, 1, note="writes the cache file"))
    files = codes_files(cache)
    if not files:
        result["error"] = f"no .codes file in {cache} after a fit: {[p.name for p in cache_files(cache)]}"
        result["fits"] = fits
        return result
    file_bytes = sum(p.stat().st_size for p in files)
    result["cache_file_bytes"] = file_bytes
    steps = args.steps or 3
    plain_read(files)  # fit A: the whole file in the page cache
    result["resident_before_in_memory"] = resident_bytes(files)
    fits.append(fit("in memory", "larger", folder, str(cache), args, steps, note="cache file in page cache"))
    target = int(file_bytes / args.ratio)
    evict(files)
    available = available_bytes()
    size = max(0, available - target)
    result["before_balloon"] = {"available": available, "total": meminfo_bytes("MemTotal"), "target": target}
    balloon = Balloon(size) if size and not args.no_balloon else None
    result["balloon"] = balloon.report if balloon else None
    try:
        result["available_with_balloon"] = available_bytes()
        result["disk"] = disk_rate(shard_files(folder), max(2 * target, 4 * GIB))
        result["available_after_disk_read"] = available_bytes()
        result["evict_before_balloon_fit"] = evict(files)
        watcher = _BalloonWatch(balloon, args.balloon_floor_gib * GIB) if balloon else None
        fits.append(
            fit(
                "balloon",
                "larger",
                folder,
                str(cache),
                args,
                steps,
                min_available_gib=0.1,
                note=f"balloon: {size / GIB:.1f} GiB held, {available_bytes() / GIB:.1f} GiB left"
                if balloon
                else "no balloon",
            )
        )
        if watcher:
            result["balloon_watch"] = watcher.stop()
    finally:
        if balloon:
            result["balloon_alive_at_end"] = balloon.alive()
            balloon.release()
    result["fits"] = fits
    return result


class _BalloonWatch:
    """Releases the balloon if the machine's available memory falls under ``floor`` (others share the machine)."""

    def __init__(self, balloon: Balloon, floor: float) -> None:
        import threading

        self.balloon, self.floor, self.lowest, self.released = balloon, floor, available_bytes(), False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.2):
            now = available_bytes()
            self.lowest = min(self.lowest, now)
            if now < self.floor and self.balloon.alive():
                self.balloon.release()
                self.released = True

    def stop(self) -> dict[str, Any]:
        self.done.set()
        self.thread.join()
        return {"lowest_available": self.lowest, "released_early": self.released}


def bench_70b(args: argparse.Namespace) -> dict[str, Any]:
    from_layers = 80
    per_layer = 1.05 * (0.5163 + CACHE_NF4_PER_WEIGHT) * 855_638_016  # folder + cache, a Llama-2-70B layer
    fixed = 4 * 32000 * 8192 * 2  # embedding + head in the folder and the cache
    layers = args.layers_70b or (2 if args.tiny else layers_that_fit(per_layer, fixed, args, from_layers))
    folder = args.data_dir / f"llama70b-bnb-nf4-{layers}l{'-tiny' if args.tiny else ''}"
    write_in_subprocess("70b", folder, layers, args)
    cache = args.data_dir / "code_cache" / "llama70b"
    shutil.rmtree(cache, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "70b",
        "folder": str(folder),
        "layers": layers,
        "folder_bytes": folder_bytes(folder),
        "free_disk_after_write": shutil.disk_usage(args.data_dir).free,
    }
    result["evict"] = evict(shard_files(folder))
    fits = [fit("first", "70b", folder, str(cache), args, args.steps or 2, note="folder cold, no cache file")]
    result["cache_files"] = {str(p.relative_to(cache)): p.stat().st_size for p in cache_files(cache)}
    if args.second:
        evict(codes_files(cache))
        fits.append(fit("second", "70b", folder, str(cache), args, args.steps or 2, note="cache file evicted first"))
    result["fits"] = fits
    return result


def bench_moe(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.code_cache.folders import QWEN3_30B_A3B

    shape = QWEN3_30B_A3B
    per_layer_params = 3 * 128 * 2048 * 768 + 2 * 2048 * 4096 + 2 * 2048 * 512 + 128 * 2048
    per_layer = 1.02 * per_layer_params * (2 + CACHE_NF4_PER_WEIGHT)
    fixed = 2 * shape["vocab_size"] * shape["hidden_size"] * (2 + CACHE_NF4_PER_WEIGHT)
    layers = args.layers_moe or (2 if args.tiny else layers_that_fit(per_layer, fixed, args, 48))
    folder = args.data_dir / f"qwen3-30b-a3b-{layers}l{'-tiny' if args.tiny else ''}"
    write_in_subprocess("moe", folder, layers, args)
    cache = args.data_dir / "code_cache" / "qwen3moe"
    shutil.rmtree(cache, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "moe",
        "folder": str(folder),
        "layers": layers,
        "folder_bytes": folder_bytes(folder),
    }
    result["evict"] = evict(shard_files(folder))
    fits = [fit("first", "moe", folder, str(cache), args, args.steps or 2, note="folder cold, no cache file")]
    result["cache_files"] = {str(p.relative_to(cache)): p.stat().st_size for p in cache_files(cache)}
    evict(codes_files(cache))
    fits.append(fit("second", "moe", folder, str(cache), args, args.steps or 2, note="cache file evicted first"))
    result["fits"] = fits
    return result


BENCHES = {"fit13b": bench_fit13b, "larger": bench_larger, "70b": bench_70b, "moe": bench_moe}


# ------------------------------------------------------------------------------------------------ report


def _anon_peak(rank: dict[str, Any]) -> Optional[int]:
    peaks = [rank.get(k, {}).get("anon") for k in ("load_peaks", "train_peaks", "train_peaks_so_far")]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


def _kind_peak(rank: dict[str, Any], kind: str) -> Optional[int]:
    peaks = [rank.get(k, {}).get(kind) for k in ("load_peaks", "train_peaks", "train_peaks_so_far")]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


def _g(value: Optional[float], digits: int = 2) -> str:
    return "—" if value is None else f"{value / GIB:.{digits}f}"


def _s(value: Optional[float], digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _fit_rows(record: dict[str, Any]) -> list[str]:
    from benchmarks.harness.tables import table

    rows = []
    first = next((f for f in record["fits"] if f["name"] == "first"), None)
    first_at = first["rank0"].get("first_step_at") if first else None
    for f in record["fits"]:
        rank = f["rank0"]
        at = rank.get("first_step_at")
        io0, io1 = rank.get("io_at_start", {}), rank.get("io_at_first_step", {})
        read = io1.get("read_bytes", 0) - io0.get("read_bytes", 0) if io1 else None
        rows.append(
            [
                f["name"],
                f["note"],
                f["outcome"]["status"],
                _s(at),
                _s(at / first_at, 3) if at and first_at else "—",
                _s(rank.get("times", {}).get("from_pretrained_s")),
                _g(read),
                _g(_anon_peak(rank)),
                _g(_kind_peak(rank, "rss")),
                _g(_kind_peak(rank, "uss")),
                " ".join(_s(s["s"]) for s in rank.get("steps", [])) or "—",
            ]
        )
    return table(
        [
            "fit",
            "",
            "status",
            "first step at s",
            "/ first",
            "from_pretrained s",
            "read to first step GiB",
            "anon peak GiB",
            "RSS peak GiB",
            "USS peak GiB",
            "steps s",
        ],
        rows,
    )


def _larger_rows(record: dict[str, Any]) -> list[str]:
    from benchmarks.harness.tables import table

    rate = record.get("disk", {}).get("mib_s")
    by_name = {f["name"]: f for f in record["fits"]}
    memory_steps = [s["s"] for s in by_name.get("in memory", {}).get("rank0", {}).get("steps", [])]
    in_memory = sorted(memory_steps)[len(memory_steps) // 2] if memory_steps else None
    rows = []
    for name in ("in memory", "balloon"):
        for index, step in enumerate(by_name.get(name, {}).get("rank0", {}).get("steps", [])):
            at_rate = step["read_bytes"] / (rate * 2**20) if rate else None
            floor = max(x for x in (in_memory, at_rate) if x is not None) if (in_memory or at_rate) else None
            rows.append(
                [
                    name,
                    index,
                    _s(step["s"]),
                    _g(step["read_bytes"]),
                    step["major_faults"],
                    _s(at_rate),
                    _s(floor),
                    _s(step["s"] / floor, 2) if floor else "—",
                    _g(step["anon_after"]),
                ]
            )
    return table(
        [
            "fit",
            "step",
            "s",
            "read from disk GiB",
            "major faults",
            "s at disk rate",
            "floor s",
            "/ floor",
            "anon after GiB",
        ],
        rows,
    )


def report(out: Path) -> str:
    data = read_json(out / "code_cache.json") if (out / "code_cache.json").exists() else {"records": []}
    latest: dict[str, dict[str, Any]] = {}
    for record in data["records"]:
        latest[record["bench"] + (" tiny" if record.get("tiny") else "")] = record
    lines = ["# Code cache benchmarks (`benchmarks/code_cache/run.py`)", ""]
    for key, record in latest.items():
        lines += [
            f"## {key}",
            "",
            f"{record['date']}, commit {record['commit']}, {record['cpu']},"
            f" {record['machine']}; load average {record['load_before']} before, {record['load_after']} after.",
            "",
        ]
        facts = {
            k: v
            for k, v in record.items()
            if k not in ("fits", "bench", "date", "commit", "cpu", "machine", "load_before", "load_after", "versions")
        }
        lines += ["```", json.dumps(facts, indent=1, default=str)[:3000], "```", ""]
        if record.get("fits"):
            lines += _fit_rows(record) + [""]
        if record["bench"] == "larger" and record.get("fits"):
            lines += _larger_rows(record) + [""]
        for f in record.get("fits", []):
            log = f["rank0"].get("log") or []
            if log:
                lines += [f"{f['name']}: the package's lines", "```", *log[-12:], "```", ""]
            if f.get("log_tail"):
                lines += [f"{f['name']}: log tail", "```", f["log_tail"][-1500:], "```", ""]
    text = "\n".join(lines) + "\n"
    (out / "code_cache.md").write_text(text)
    return text


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        from benchmarks.code_cache.worker import run as run_worker

        run_worker(Path(sys.argv[2]))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "balloon":
        balloon_main(int(sys.argv[2]))
        return
    if len(sys.argv) >= 5 and sys.argv[1] == "write":
        from benchmarks.code_cache import folders

        kind, folder, layers, tiny = sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), "--tiny" in sys.argv
        if kind == "70b":
            problems = folders.check_bnb_layout()
            if problems:
                raise SystemExit(f"the bitsandbytes layout differs: {problems}")
            folders.write_llama_bnb_nf4(folder, layers, shape=TINY_LLAMA if tiny else None)
        else:
            folders.write_qwen3_moe(folder, layers, shape=TINY_MOE if tiny else None)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="run", choices=("run", "report", "clean"))
    parser.add_argument("--bench", nargs="+", choices=list(BENCHES), default=["fit13b"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: check the plumbing in minutes")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, help="steps a fit runs (default: fit13b 1, larger 3, 70b and moe 2)")
    parser.add_argument("--off", action="store_true", help="fit13b: also a fit with code_cache=False first")
    parser.add_argument("--second", action="store_true", help="70b: also a fit from the cache file")
    parser.add_argument("--ratio", type=float, default=1.6, help="larger: cache file / memory the run may have")
    parser.add_argument("--no-balloon", action="store_true")
    parser.add_argument("--balloon-floor-gib", type=float, default=0.25)
    parser.add_argument("--layers-70b", type=int)
    parser.add_argument("--layers-moe", type=int)
    parser.add_argument("--reserve-gib", type=float, default=8.0, help="disk space left free for others")
    parser.add_argument("--timeout-min", type=float, default=60.0)
    parser.add_argument("--memory-limit-gib", type=float, default=21.0)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the big folders and caches (default: the 70b and moe ones are removed after their bench)",
    )
    args = parser.parse_args()
    if args.command == "report":
        print(report(args.out))
        return
    if args.command == "clean":
        for path in [
            args.data_dir / "code_cache",
            args.data_dir / "runs" / "code_cache",
            *args.data_dir.glob("llama70b-bnb-nf4-*"),
            *args.data_dir.glob("qwen3-30b-a3b-*"),
        ]:
            print(f"removing {path}")
            shutil.rmtree(path, ignore_errors=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for bench in args.bench:
        started = now_utc()
        load_before = load_average()
        print(f"\n=== {bench}{' (tiny)' if args.tiny else ''} at {started}", flush=True)
        result = BENCHES[bench](args)
        record = dict(
            result,
            date=started,
            tiny=args.tiny,
            commit=git_commit(),
            cpu=cpu_model(),
            machine=machine(),
            load_before=load_before,
            load_after=load_average(),
            versions=versions(),
        )
        append_record(args.out / "code_cache.json", record)
        report(args.out)
        if bench in ("70b", "moe") and not args.keep:
            shutil.rmtree(result["folder"], ignore_errors=True)
            shutil.rmtree(
                args.data_dir / "code_cache" / ("llama70b" if bench == "70b" else "qwen3moe"), ignore_errors=True
            )


if __name__ == "__main__":
    main()
