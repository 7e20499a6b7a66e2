"""Host memory of a save and of a resume with most of a model trainable, 2 CPU ranks: the package before issue 38
(every rank gathers the whole trainable state, every rank loads the whole file) against this checkout (each tensor
gathered to rank 0 alone as the file is written; each rank reads its own part of a memory-mapped file).

A Llama-architecture model with random weights written with ``save_pretrained`` (bf16, 134M params) is loaded in
``configure_model`` with everything but the input embedding trainable (110M params), AdamW. Each configuration runs
in fresh processes, twice: ``save`` trains ``--steps`` steps and saves, ``resume`` fits on from that file for as many
steps. A thread in each rank samples its unique memory (USS, psutil) every 50 ms; the phases:

    save run:    load (process start to the first step), steps, save (``trainer.save_checkpoint``)
    resume run:  load (process start to the strategy's ``load_checkpoint``), resume (to the first step), steps

node peak of a phase = sum over ranks of each rank's peak USS in it (the phases end together: they end in collectives).
The goals: a save's node peak at most 1.1x the node peak of the steps before it, a resume's at most 1.1x the node peak
of the steps after it. Memory as a user's process holds it: no allocator setting in the environment.

    python benchmarks/save_memory/run.py     # 2 precisions x 2 codes x 2 runs: ~12 min on 2 shared cores
    python benchmarks/save_memory/run.py --precisions bf16-mixed --out /tmp/trial

``--before REV`` (default fd1efc5, the commit before) is the code compared against, extracted with ``git archive``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import launch, probes  # noqa: E402
from benchmarks.harness.probes import (  # noqa: E402
    PeakSampler,
    load_average,
    machine,
    proc_status_bytes,
    reset_peak_rss,
)
from benchmarks.harness.records import (  # noqa: E402
    REPO,
    RankReport,
    git_commit,
    now_utc,
    read_json,
    read_rank_reports,
    versions,
    write_json,
)
from benchmarks.harness.tables import gib, num, ratio, table  # noqa: E402

HERE = Path(__file__).resolve().parent
BEFORE = "fd1efc5"
SAMPLE_SECONDS = 0.05
# 12 layers x 7,079,424 + 2 x 24,576,000 (untied embedding and head) + 768 (final norm) = 134,105,856 params; all but
# the input embedding train: 109,529,856
LLAMA = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
SEQUENCE, BATCH, TOKENS = 32, 2, 1000
PHASES = {"save": ("load", "steps", "save"), "resume": ("load", "resume", "steps")}


# --------------------------------------------------------------------------------------------------- the worker


def worker(mode: str, base: Path, checkpoint: Path, out: Path, precision: str, steps: int) -> None:
    """One rank of a ``save`` or ``resume`` run; writes ``rank<N>.json`` to ``out`` after each phase."""
    probes.SAMPLER_SHARE = 5  # a resume lasts about a second: sample more often (a fifth of a core at most)
    reset_peak_rss()
    sampler = PeakSampler(SAMPLE_SECONDS)
    sampler.start()
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_frozen

    torch.set_num_threads(1)
    report = RankReport(out)
    phases: dict[str, Any] = {}
    started = [time.perf_counter()]

    def end_phase(name: str) -> None:
        peaks, hwm = sampler.end_phase(), proc_status_bytes("VmHWM")
        reset_peak_rss()  # the kernel's high-water mark of RSS: exact, where the sampled USS may miss a short peak
        now = time.perf_counter()
        phases[name] = {"peak_uss": peaks["uss"], "peak_anon": peaks["anon"], "peak_rss": hwm}
        phases[name]["s"] = round(now - started[0], 2)
        started[0] = now
        report.update(phases=phases)

    class Phases(L.Callback):
        def on_train_start(self, *args: Any) -> None:
            end_phase("resume" if mode == "resume" else "load")

        def on_train_end(self, *args: Any) -> None:
            end_phase("steps")

    class Measured(lightning_frozen.FrozenAwareDeepSpeedStrategy):
        def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            end_phase("load")
            return super().load_checkpoint(*args, **kwargs)

    class CausalLM(L.LightningModule):
        def configure_model(self) -> None:
            from transformers import AutoModelForCausalLM

            if not hasattr(self, "model"):
                self.model = AutoModelForCausalLM.from_pretrained(base)
                self.model.model.embed_tokens.requires_grad_(False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (input_ids,) = batch
            return self.model(input_ids=input_ids, labels=input_ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    tokens = torch.randint(0, TOKENS, (BATCH * steps * 4, SEQUENCE), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=Measured(),
        precision=precision,
        max_steps=steps * (2 if mode == "resume" else 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Phases()],
    )
    module = CausalLM()
    try:
        trainer.fit(
            module,
            DataLoader(TensorDataset(tokens), batch_size=BATCH),
            ckpt_path=checkpoint if mode == "resume" else None,
        )
        if mode == "save":
            trainer.save_checkpoint(checkpoint)
            end_phase("save")
    except Exception:
        report.error(mode)
        raise
    trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad)
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())
    report.update(trainable_params=trainable, params=total, global_step=trainer.global_step)
    sampler.stop()


# --------------------------------------------------------------------------------------------------- the driver


def write_base(folder: Path) -> None:
    """The random-weight bf16 Llama, written with ``save_pretrained`` (run in a process of its own)."""
    from examples.causal_lm_lora.make_base import write_random_llama

    write_random_llama(folder, LLAMA)


def extract(rev: str, into: Path) -> Path:
    """The package as of ``rev`` (``git archive``), in ``into``; returns ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "lightning_frozen"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_one(code: str, package: Path, precision: str, mode: str, paths: dict[str, Path], args: Any) -> dict:
    name = f"{code}-{precision}-{mode}"
    out = paths["runs"] / name
    checkpoint = paths["runs"] / f"{code}-{precision}.ckpt"
    command = [sys.executable, __file__, "--worker", mode, str(paths["base"]), str(checkpoint), str(out)]
    command += ["--precision", precision, "--steps", str(args.steps), "--package", str(package)]
    env = launch.child_env(threads=1, mmap_1mib=False, package=package)
    load_before = load_average()
    outcome = launch.guarded_run(command, env, paths["runs"] / f"{name}.log", args.timeout / 60, reports_dir=out)
    ranks = read_rank_reports(out)
    record = dict(code=code, precision=precision, mode=mode, outcome=outcome, ranks=ranks, load_before=load_before)
    if mode == "save" and checkpoint.exists():
        record["checkpoint_bytes"] = checkpoint.stat().st_size
    if len(ranks) < 2 or outcome["status"] != "ok" or outcome["returncode"]:
        record["log_tail"] = (paths["runs"] / f"{name}.log").read_text()[-3000:]
    print(f"{name}: {launch.exit_status(outcome)} in {outcome['wall_s']} s", flush=True)
    return record


def same_files(a: Path, b: Path) -> Optional[bool]:
    """Whether two checkpoints hold bit-equal trainable tensors (None where one is missing); run in a subprocess."""
    if not (a.exists() and b.exists()):
        return None
    script = (
        "import sys, torch\n"
        "a, b = (torch.load(p, weights_only=True, mmap=True) for p in sys.argv[1:])\n"
        "def flat(c):\n"
        "    yield from (('sd', n, t) for n, t in c['state_dict'].items())\n"
        "    for n, s in c['optimizer_states'][0]['state'].items():\n"
        "        yield from ((n, k, t) for k, t in s.items() if torch.is_tensor(t))\n"
        "fa, fb = list(flat(a)), list(flat(b))\n"
        "same = [x[:2] for x in fa] == [x[:2] for x in fb] and all(\n"
        "    x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))\n"
        "    for (_, _, x), (_, _, y) in zip(fa, fb))\n"
        "print(same)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(a), str(b)], capture_output=True, text=True)
    return result.stdout.strip() == "True" if result.returncode == 0 else None


def node_peak(record: dict, phase: str, kind: str = "uss") -> Optional[int]:
    ranks = record["ranks"]
    if len(ranks) != 2 or any(phase not in r.get("phases", {}) for r in ranks):
        return None
    return sum(r["phases"][phase][f"peak_{kind}"] for r in ranks)


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        row: dict[str, Any] = {key: run[key] for key in ("code", "precision", "mode")}
        for phase in PHASES[run["mode"]]:
            row[f"node_{phase}"] = node_peak(run, phase)
            row[f"anon_{phase}"] = node_peak(run, phase, "anon")
            row[f"rss_{phase}"] = node_peak(run, phase, "rss")
            row[f"ranks_{phase}"] = [r.get("phases", {}).get(phase, {}).get("peak_uss") for r in run["ranks"]]
            row[f"{phase}_s"] = max((r.get("phases", {}).get(phase, {}).get("s") or 0) for r in run["ranks"]) or None
        key = "save" if run["mode"] == "save" else "resume"
        row["ratio"] = ratio(row[f"node_{key}"], row["node_steps"])
        row["anon_ratio"] = ratio(row[f"anon_{key}"], row["anon_steps"])
        row["rss_ratio"] = ratio(row[f"rss_{key}"], row["rss_steps"])
        row["checkpoint_bytes"] = run.get("checkpoint_bytes")
        failed = run["outcome"]["status"] != "ok" or run["outcome"]["returncode"]
        row["error"] = str(launch.exit_status(run["outcome"])) if failed else None
        rows.append(row)
    return rows


def write_results(results: dict, out: Path) -> None:
    write_json(out / "save_memory.json", results)
    meta = results["meta"]
    lines = [
        "# Host memory of a save and of a resume, 110M of 134M params trainable, 2 CPU ranks",
        "",
        f"`python benchmarks/save_memory/run.py` on {meta['machine']} ({meta['cpu']}), {meta['date']}; code"
        f" `{meta['commit']}` against `{meta['before']}`; {meta['steps']} steps per run, sequence {SEQUENCE}, batch"
        f" {BATCH} per rank; load average before {meta['load_before']}, after {meta['load_after']}. Node peak: the"
        " sum over the 2 ranks of each rank's peak USS in the phase (GiB); per rank in brackets. **ratio**: the save's"
        " (or resume's) node peak over the node peak of the same run's steps. anon: the same with anonymous memory"
        " only (`RssAnon`, sampled: USS without the pages of files a rank alone maps, such as its part of a"
        " memory-mapped checkpoint during a resume). Peak RSS: the kernel's high-water mark (`VmHWM`, reset at each"
        " phase's start), exact where a sample may miss a short peak, but counting the pages the ranks share (the"
        " libraries) in each. Each rank samples its USS every 50 ms, or less often where a sample is slow (at most a"
        " fifth of a core).",
        "",
    ]
    header = ["code", "precision", "run", "steps: node peak", "save / resume: node peak", "**ratio**", "goal ≤ 1.1"]
    header += ["anon ratio", "peak RSS: steps", "peak RSS: save / resume", "RSS ratio", "phase s", "checkpoint"]
    cells = []
    for row in results["rows"]:
        phase = "save" if row["mode"] == "save" else "resume"

        def peak(name: str, row: dict = row) -> str:
            ranks = ", ".join(gib(v) for v in row[f"ranks_{name}"] if v is not None)
            return f"{gib(row[f'node_{name}'])} ({ranks})" if row[f"node_{name}"] else "—"

        met = "—" if row["ratio"] is None else ("met" if row["ratio"] <= 1.1 else "not met")
        cells.append(
            [
                row["code"],
                f"`{row['precision']}`",
                row["mode"],
                peak("steps"),
                peak(phase),
                f"**{num(row['ratio'])}**",
                met if not row["error"] else f"run failed: {row['error']}",
                num(row.get("anon_ratio")),
                gib(row.get("rss_steps")),
                gib(row.get(f"rss_{phase}")),
                num(row.get("rss_ratio")),
                num(row[f"{phase}_s"], 1),
                f"{gib(row['checkpoint_bytes'])} GiB" if row["checkpoint_bytes"] else "",
            ]
        )
    lines += table(header, cells)
    same = ", ".join(
        f"`{p}` {'yes' if same else 'no' if same is False else '—'}" for p, same in meta["same_files"].items()
    )
    lines += ["", f"Files the two codes wrote, tensor by tensor bit-equal: {same}.", ""]
    (out / "save_memory.md").write_text("\n".join(lines) + "\n")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "BASE", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--write-base", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="32-true", help=argparse.SUPPRESS)
    parser.add_argument("--package", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--steps", type=int, default=3, help="training steps in each run")
    parser.add_argument("--before", default=BEFORE, help="the commit to compare against")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--report", action="store_true", help="only rewrite save_memory.md from save_memory.json")
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(args.package))  # the code measured, before the checkout this script is in
        mode, base, checkpoint, out = args.worker
        worker(mode, Path(base), Path(checkpoint), Path(out), args.precision, args.steps)
        return
    if args.write_base:
        write_base(args.write_base)
        return
    if args.report:
        results = read_json(args.out / "save_memory.json")
        results["rows"] = summarize(results["runs"])
        write_results(results, args.out)
        print((args.out / "save_memory.md").read_text())
        return

    started, load_before = time.perf_counter(), load_average()
    with tempfile.TemporaryDirectory(prefix="save_memory_") as scratch:
        paths = {"base": Path(scratch, "base"), "runs": Path(scratch, "runs")}
        env = launch.child_env(threads=1)
        subprocess.run([sys.executable, __file__, "--write-base", str(paths["base"])], env=env, check=True)
        codes = {"before": extract(args.before, Path(scratch, "before")), "after": REPO}
        runs = [
            run_one(code, package, precision, mode, paths, args)
            for precision in args.precisions
            for code, package in codes.items()
            for mode in ("save", "resume")
        ]
        same = {p: same_files(*(paths["runs"] / f"{c}-{p}.ckpt" for c in codes)) for p in args.precisions}
    meta = dict(
        date=now_utc(),
        machine=machine(),
        cpu=cpu_name(),
        commit=git_commit(),
        before=args.before,
        versions=versions(),
        steps=args.steps,
        load_before=load_before,
        load_after=load_average(),
        wall_s=round(time.perf_counter() - started, 1),
        same_files=same,
    )
    results = {"meta": meta, "rows": summarize(runs), "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(results, args.out)
    print((args.out / "save_memory.md").read_text())


if __name__ == "__main__":
    main()
