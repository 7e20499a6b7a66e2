"""A merged model for serving: ``export_merged`` beside PEFT's ``merge_and_unload`` + ``save_pretrained``.

A TinyLlama-1.1B-shaped Llama with random weights, written in bf16 with ``save_pretrained`` (one 2.2 GB shard), and
two LoRA adapters (r=16), each moved off its initial values: on q and v (the usual), and on every linear layer of the
decoder (q, k, v, o, gate, up, down: the most merging). Each checkpoint is the file a save of that module writes
(``saved_checkpoint``: trainable tensors in fp32, fingerprint, PEFT entry), built without a fit: a step of 1.1B on 2
shared cores is not what this study measures. Each way runs in a fresh process, with the base folder's files in the
page cache (read once before each run):

    ours:   export_merged(checkpoint, out)
    PEFT:   export_peft_adapter(checkpoint, adapter); AutoModelForCausalLM.from_pretrained(base, dtype=bf16);
            PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out); every file fsynced
    copy:   each file of the base read once and written once (64 MiB buffer), fsynced: the time floor (run before
            and after the others; their mean)

Memory: the peak USS of the process (psutil, sampled every 50 ms) over its USS just before the call, after every
import, as a ratio to the model's bytes. Goals: ours ≤ 0.1x, where PEFT's way is ≥ 1.0x; ours ≤ 1.3x the copy's time.
The two ways' folders are then compared tensor by tensor.

    flock /tmp/lf-2rank.lock python benchmarks/merged_export/run.py     # ~5 min on 2 shared cores; 9 GB of disk
    python benchmarks/merged_export/run.py --report                      # rewrite the table from the JSON
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.probes import PeakSampler, cpu_model, load_average, machine, memory_now, prepare_cache  # noqa: E402
from benchmarks.harness.records import (
    RankReport,
    git_commit,
    now_utc,
    read_json,
    read_rank_reports,
    versions,
    write_json,
)  # noqa: E402
from benchmarks.harness.tables import gib, mib, num, ratio, table  # noqa: E402

HERE = Path(__file__).resolve().parent
TINYLLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
# a shape for a trial of the script (`--trial`), not for results
TRIAL = dict(TINYLLAMA, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4)
# the adapters: LoRA r=16 on q and v (the usual), and on every linear layer of the decoder (the most merging)
ADAPTERS = {
    "q_v": ["q_proj", "v_proj"],
    "all_linear": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
COPY_BUFFER = 64 * 2**20


# --------------------------------------------------------------------------------------------------- the workers


def write_base(base: Path, trial: bool) -> None:
    import torch

    from examples.causal_lm_lora.make_base import write_random_llama

    write_random_llama(base, TRIAL if trial else TINYLLAMA, torch.bfloat16)


def write_checkpoint(base: Path, checkpoint: Path, adapter: Path, targets: list[str]) -> None:
    """The file a save of a LoRA module over ``base`` writes, and PEFT's adapter folder exported from it."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    import lightning_frozen
    from lightning_frozen import anatomy
    from lightning_frozen.base.fingerprint import fingerprint_base, named_frozen
    from lightning_frozen.checkpoint.trainable_state import saved_checkpoint

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
            self.model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets))

    torch.manual_seed(0)
    module = Module()
    with torch.no_grad():  # moved off PEFT's initial values (B = 0), as training moves them
        for param in module.parameters():
            if param.requires_grad:
                param.normal_(0, 0.02)
    found = anatomy.anatomy_of(module)
    state = {name: p.detach().float().clone() for name, p in module.named_parameters() if p.requires_grad}
    fingerprint = fingerprint_base(named_frozen(module, copies=found.trained_copies))
    torch.save(saved_checkpoint({"state_dict": state}, module, found, fingerprint, world_size=1), checkpoint)
    lightning_frozen.export_peft_adapter(checkpoint, adapter)


def fsynced(folder: Path) -> None:
    for path in folder.iterdir():
        descriptor = os.open(path, os.O_RDONLY)
        os.fsync(descriptor)
        os.close(descriptor)


def run_way(way: str, paths: dict[str, Path], out: Path) -> None:
    """One way, measured: its peak USS over the USS before the call, and its wall time."""
    report = RankReport(out)
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    import lightning_frozen

    gc.collect()
    sampler = PeakSampler(0.05)
    sampler.start()
    floor = memory_now()["uss"]
    sampler.end_phase()
    started = time.perf_counter()
    target = paths["scratch"] / f"out-{way}"
    try:
        if way == "ours":
            lightning_frozen.export_merged(paths["checkpoint"], target)
        elif way == "peft":
            model = AutoModelForCausalLM.from_pretrained(str(paths["base"]), dtype=torch.bfloat16)
            merged = peft.PeftModel.from_pretrained(model, str(paths["adapter"])).merge_and_unload()
            merged.save_pretrained(target)
            fsynced(target)
        else:
            target.mkdir()
            buffer = memoryview(bytearray(COPY_BUFFER))
            for source in sorted(paths["base"].iterdir()):
                with open(source, "rb", buffering=0) as reading, open(target / source.name, "wb") as writing:
                    while count := reading.readinto(buffer):
                        writing.write(buffer[:count])
            fsynced(target)
    except Exception:
        report.error(way)
        raise
    seconds = time.perf_counter() - started
    peak = sampler.end_phase()["uss"]
    sampler.stop()
    written = sum(p.stat().st_size for p in target.iterdir())
    report.update(way=way, floor_uss=floor, peak_uss=peak, over_floor=peak - floor, s=round(seconds, 2), bytes=written)


def compare(ours: Path, theirs: Path, out: Path) -> None:
    """Tensor by tensor: names, dtypes and values of the two folders (one tensor of each in memory at a time)."""
    import torch
    from safetensors import safe_open

    def opened(folder: Path) -> dict[str, Any]:
        return {
            key: handle
            for path in folder.glob("*.safetensors")
            for handle in [safe_open(str(path), "pt")]
            for key in sorted(handle.keys())
        }

    a, b = opened(ours), opened(theirs)
    equal, worst = 0, 0.0
    for key in sorted(set(a) & set(b)):
        x, y = a[key].get_tensor(key), b[key].get_tensor(key)
        equal += int(x.dtype == y.dtype and torch.equal(x, y))
        worst = max(worst, float((x.float() - y.float()).abs().max()))
    RankReport(out).update(names_equal=set(a) == set(b), tensors=len(a), bit_equal=equal, max_abs_diff=worst)


# --------------------------------------------------------------------------------------------------- the driver


def worker(args: list[str], runs: Path, name: str, timeout_min: float = 20) -> dict[str, Any]:
    out = runs / name
    command = [sys.executable, __file__, "--worker", *args, str(out)]
    outcome = launch.guarded_run(command, launch.child_env(), runs / f"{name}.log", timeout_min, reports_dir=out)
    reports = read_rank_reports(out) if out.exists() else []
    print(f"{name}: {launch.exit_status(outcome)} in {outcome['wall_s']} s", flush=True)
    if outcome["status"] != "ok" or outcome["returncode"]:
        raise RuntimeError(f"{name} failed:\n" + (runs / f"{name}.log").read_text()[-3000:])
    return {"outcome": outcome, **(reports[0] if reports else {})}


def measure(scratch: Path, trial: bool) -> dict[str, Any]:
    runs = scratch / "runs"
    worker(["base", str(scratch / "base"), "trial" if trial else "full"], runs, "write-base")
    files = sorted((scratch / "base").glob("*.safetensors"))
    results: dict[str, Any] = {"model_bytes": sum(p.stat().st_size for p in files), "trial": trial, "runs": {}}
    layers = (TRIAL if trial else TINYLLAMA)["num_hidden_layers"]
    results["merged_layers"] = {name: layers * len(targets) for name, targets in ADAPTERS.items()}
    cleared = ["checkpoint", "adapter", "out-ours", "out-peft"]
    ways = [("copy", "copy", None)] + [(f"{way}-{name}", way, name) for name in ADAPTERS for way in ("ours", "peft")]
    for label, way, adapter in [*ways, ("copy-after", "copy", None)]:
        if way == "ours":
            for name in cleared:
                subprocess.run(["rm", "-rf", str(scratch / name)], check=True)
            arguments = [str(scratch / "base"), str(scratch / "checkpoint"), str(scratch / "adapter"), adapter]
            worker(["checkpoint", *arguments], runs, f"checkpoint-{adapter}")
        results["cache"] = prepare_cache(files, "warm")
        results["runs"][label] = worker(["way", way, str(scratch)], runs, label)
        subprocess.run(["rm", "-rf", str(scratch / "out-copy")], check=True)
        if way == "peft":
            compared = [str(scratch / "out-ours"), str(scratch / "out-peft")]
            results["runs"][label]["compare"] = worker(["compare", *compared], runs, f"compare-{adapter}")
    return results


def write_results(results: dict[str, Any], out: Path) -> None:
    write_json(out / "merged_export.json", results)
    meta, runs = results["meta"], results["runs"]
    model = results["model_bytes"]
    floor_s = (runs["copy"]["s"] + runs["copy-after"]["s"]) / 2
    lines = [
        "# A merged model for serving: export_merged beside PEFT's merge_and_unload + save_pretrained",
        "",
        f"`python benchmarks/merged_export/run.py`, {meta['date']}, commit {meta['commit']}, {meta['cpu']}"
        f" ({meta['machine']}); load average {meta['load_before']} before, {meta['load_after']} after"
        f" ({meta['wall_s']:.0f} s). TinyLlama-1.1B shape, random weights, bf16, {gib(model)} GiB in one shard;"
        " LoRA r=16 (fp32 in the checkpoint, as a save writes it) on q and v, and on every linear layer of the decoder."
        " Page cache warm (the base read once before each run); every written file fsynced. Memory: the process's"
        " peak USS over its USS just before the call (after every import), per model byte. Time: wall time of the"
        " call, per the time of reading and writing the bytes once (the copy: the mean of a run before the others and"
        f" one after, {num(runs['copy']['s'], 1)} s and {num(runs['copy-after']['s'], 1)} s).",
        "",
    ]
    header = ["adapter", "way", "peak over floor (MiB)", "**/ model bytes**", "goal", "time (s)", "**/ copy**", "goal"]
    header.append("folders bit-equal")
    cells = []
    for name, targets in ADAPTERS.items():
        described = f"{', '.join(targets)} ({results['merged_layers'][name]} layers)"
        for way in ("ours", "peft"):
            run = runs[f"{way}-{name}"]
            memory, seconds = ratio(run["over_floor"], model), ratio(run["s"], floor_s)
            ours = way == "ours"
            same = runs[f"peft-{name}"]["compare"]
            cells.append(
                [
                    described if ours else "",
                    "`export_merged`" if ours else "PEFT `merge_and_unload` + `save_pretrained`",
                    mib(run["over_floor"], 0),
                    f"**{num(memory)}x**",
                    ("met" if memory <= 0.1 else "not met") if ours else f"≥ 1.0: {'yes' if memory >= 1.0 else 'no'}",
                    num(run["s"], 1),
                    f"**{num(seconds)}x**",
                    ("met" if seconds <= 1.3 else "not met") if ours else "",
                    "" if ours else f"{same['bit_equal']} of {same['tensors']} (names equal: {same['names_equal']})",
                ]
            )
    lines += table(header, cells)
    (out / "merged_export.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--scratch", type=Path, default=None, help="where the 9 GB of folders go (default: /tmp)")
    parser.add_argument("--trial", action="store_true", help="a 2-layer model: try the script (use with --out)")
    parser.add_argument("--report", action="store_true", help="only rewrite merged_export.md from merged_export.json")
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "base":
            write_base(Path(rest[0]), rest[1] == "trial")
        elif kind == "checkpoint":
            write_checkpoint(Path(rest[0]), Path(rest[1]), Path(rest[2]), ADAPTERS[rest[3]])
        elif kind == "way":
            scratch = Path(rest[1])
            paths = {name: scratch / name for name in ("base", "checkpoint", "adapter")}
            paths["scratch"] = scratch
            run_way(rest[0], paths, Path(rest[2]))
        else:
            compare(Path(rest[0]), Path(rest[1]), Path(rest[2]))
        return
    if args.report:
        write_results(read_json(args.out / "merged_export.json"), args.out)
        print((args.out / "merged_export.md").read_text())
        return
    started, load_before = time.perf_counter(), load_average()
    with tempfile.TemporaryDirectory(prefix="merged_export_", dir=args.scratch) as scratch:
        results = measure(Path(scratch), args.trial)
    results["meta"] = dict(
        date=now_utc(),
        machine=machine(),
        cpu=cpu_model(),
        commit=git_commit(),
        versions=versions(),
        load_before=load_before,
        load_after=load_average(),
        wall_s=round(time.perf_counter() - started, 1),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(results, args.out)
    print((args.out / "merged_export.md").read_text())


if __name__ == "__main__":
    main()
