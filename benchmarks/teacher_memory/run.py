"""Host memory of distillation from a frozen teacher twice the student's size, 2 CPU ranks, ``frozen_deepspeed``.

Two Llama-architecture folders with random weights, written with ``save_pretrained`` (bf16, the same vocabulary): a
student base and a teacher of about twice its params. A LightningModule builds both with ``from_pretrained`` in
``configure_model``: the student gets a PEFT LoRA (r=8 on ``q_proj``/``v_proj``), the teacher is
``requires_grad_(False)``; each step's loss is the student's next-token cross entropy plus a KL term to the teacher's
distribution. A few steps at ``32-true``, ``frozen_dtype`` None (fp32 shards) and ``"nf4"``, with and without the
teacher; each configuration in fresh processes under ``harness/launch.py``'s guard, as a user runs it (no allocator
setting in the environment). A thread in each rank samples its unique memory (USS) every 50 ms.

    node peak = sum over ranks of each rank's peak USS during the training steps (from ``on_train_start`` on)
    expected  = frozen bytes as stored, summed over the ranks (fp32, or NF4 codes and scales: each rank holds 1/N)
              + runtime floor x ranks (the ``floor`` run's node peak: every import, the process group and a
                DeepSpeed engine over one 8x8 linear layer, no model)
              + one layer in flight per rank (the module with the most params of its own, whole, in fp32)

The table gives node peak / expected, the teacher's measured cost (the run with it minus the run without) and, by
arithmetic, what the teacher would cost loaded outside ZeRO (whole, in fp32, on every rank).

    python benchmarks/teacher_memory/run.py                 # 5 runs of 2 ranks: ~8 min on 2 shared cores
    python benchmarks/teacher_memory/run.py --size tiny --out /tmp/teacher_trial
    python benchmarks/teacher_memory/run.py --report        # rewrite teacher_memory.md from teacher_memory.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.probes import PeakSampler, cpu_model, load_average, machine  # noqa: E402
from benchmarks.harness.records import (  # noqa: E402
    RankReport,
    git_commit,
    now_utc,
    read_json,
    read_rank_reports,
    versions,
    write_json,
)
from benchmarks.harness.tables import mib, num, ratio, table  # noqa: E402

HERE = Path(__file__).resolve().parent
SAMPLE_SECONDS = 0.05
RANKS, SEQUENCE, BATCH, COMPUTE_BYTES = 2, 32, 2, 4  # 32-true: every layer computes in fp32
LLAMA = dict(vocab_size=32000, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None)
SIZES = {
    # student: 12 x 7,079,424 + 2 x 24,576,000 + 768 = 134,105,856 params; teacher: 16 x 12,847,104 + 2 x 32,768,000
    # + 1,024 = 271,090,688 (2.02x)
    "bench": {
        "student": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
        "teacher": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16),
    },
    "tiny": {  # a trial of the study's plumbing in a minute
        "student": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4),
        "teacher": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4),
    },
}
# (name, frozen_dtype, with the teacher); "floor" builds no model
CONFIGS = (
    ("floor", None, False),
    ("fp32 student", None, False),
    ("fp32 student + teacher", None, True),
    ("nf4 student", "nf4", False),
    ("nf4 student + teacher", "nf4", True),
)


def write_llama(folder: Path, sizes: dict[str, int], seed: int) -> int:
    """Save a random-weight bf16 ``LlamaForCausalLM`` of ``sizes`` to ``folder``; return its parameter count."""
    from examples.causal_lm_lora.make_base import write_random_llama

    config = {**LLAMA, **sizes, "num_key_value_heads": sizes["num_attention_heads"]}
    return sum(p.numel() for p in write_random_llama(folder, config, seed=seed).parameters())


# --------------------------------------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace, sampler: PeakSampler) -> None:
    """Fit the student (and distil from the teacher) for ``args.steps`` steps on 2 CPU ranks; each rank writes
    ``rank<R>.json`` to ``args.run_dir`` after the load and after the steps."""
    import lightning as L
    import peft
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_frozen import FrozenAwareDeepSpeedStrategy
    from lightning_frozen.memory import largest_module_params, measured_frozen_shard_bytes
    from lightning_frozen.zero.params import full_numel

    torch.set_num_threads(1)
    report = RankReport(args.run_dir)
    step_seconds: list[float] = []

    class Distillation(L.LightningModule):
        def configure_model(self) -> None:
            if hasattr(self, "student") or hasattr(self, "head"):
                return
            if args.student is None:  # the runtime floor: the engine needs a param to optimize
                self.head = torch.nn.Linear(8, 8)
                return
            base = transformers.AutoModelForCausalLM.from_pretrained(args.student)
            lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
            self.student = peft.get_peft_model(base, lora)
            if args.teacher is not None:
                self.teacher = transformers.AutoModelForCausalLM.from_pretrained(args.teacher).requires_grad_(False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            if args.student is None:
                return self.head(ids[:, :8].float()).square().mean()
            logits = self.student(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            if args.teacher is None:
                return loss
            with torch.no_grad():
                teacher = self.teacher(input_ids=ids).logits
            distill = torch.nn.functional.kl_div(
                logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean"
            )
            return loss + distill

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    class Phases(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            frozen = [p for p in module.parameters() if not p.requires_grad]
            teacher = getattr(module, "teacher", None)
            report.update(
                load_peaks=sampler.end_phase(),  # the steps' peaks start from what is held now
                frozen_params=sum(full_numel(p) for p in frozen),
                teacher_params=sum(full_numel(p) for p in teacher.parameters()) if teacher is not None else 0,
                frozen_shard_bytes=measured_frozen_shard_bytes(frozen)[0] + quant_scale_bytes(frozen),
                largest_module_params=largest_module_params(module),
            )

        def on_train_batch_start(self, *args: Any) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            step_seconds.append(time.perf_counter() - self.started)

    tokens = torch.randint(0, 1000, (BATCH * RANKS * args.steps, SEQUENCE), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=FrozenAwareDeepSpeedStrategy(frozen_dtype=args.frozen_dtype),
        precision="32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Phases()],
    )
    try:
        trainer.fit(Distillation(), DataLoader(TensorDataset(tokens), batch_size=BATCH))
    except Exception:
        report.error("fit")
        raise
    sampler.stop()
    report.update(
        step_peaks=sampler.end_phase(),
        steps=trainer.global_step,
        step_s=round(statistics.median(step_seconds[1:] or step_seconds), 3),
    )


def quant_scale_bytes(frozen: list[Any]) -> int:
    """Bytes of the scales a quantized shard carries beside its codes (``ds_tensor.ds_quant_scale``)."""
    scales = (getattr(p.ds_tensor, "ds_quant_scale", None) for p in frozen if hasattr(p, "ds_tensor"))
    return sum(s.numel() * s.element_size() for s in scales if s is not None)


# --------------------------------------------------------------------------------------------------- the driver


def run_one(config: tuple[str, Optional[str], bool], folders: dict[str, Path], scratch: Path, args: Any) -> dict:
    """One configuration in fresh processes; its record with both ranks' reports."""
    name, frozen_dtype, with_teacher = config
    run_dir = scratch / name.replace(" ", "_").replace("+", "and")
    command = [sys.executable, __file__, "--worker", str(run_dir), "--steps", str(args.steps)]
    if name != "floor":
        command += ["--student", str(folders["student"])]
    if with_teacher:
        command += ["--teacher", str(folders["teacher"])]
    if frozen_dtype:
        command += ["--frozen-dtype", frozen_dtype]
    load_before = load_average()
    env = launch.child_env(threads=1, mmap_1mib=args.mmap_1mib)
    outcome = launch.guarded_run(command, env, run_dir / "worker.log", args.timeout / 60, reports_dir=run_dir)
    ranks = read_rank_reports(run_dir)
    record = dict(name=name, frozen_dtype=frozen_dtype, teacher=with_teacher, load_before=load_before, ranks=ranks)
    record.update(outcome=outcome)
    if len(ranks) != RANKS or any(r["errors"] or "step_peaks" not in r for r in ranks):
        record["log_tail"] = (run_dir / "worker.log").read_text()[-3000:]
    print(f"{name}: {outcome['status']}, exit {outcome['returncode']} in {outcome['wall_s']} s", flush=True)
    return record


def node_sum(record: Optional[dict], get: Any) -> Optional[int]:
    """The sum over ranks of ``get(rank report)``; None unless every rank finished its steps."""
    if record is None or "log_tail" in record:
        return None
    return sum(get(rank) for rank in record["ranks"])


def summarize(records: list[dict], params: dict[str, int]) -> list[dict]:
    """One row per configuration: node peak, the expected figure and its parts, and the teacher's costs."""
    by_name = {r["name"]: r for r in records}
    floor = node_sum(by_name.get("floor"), lambda r: r["step_peaks"]["uss"])
    rows = []
    for record in records:
        if record["name"] == "floor":
            continue
        row: dict[str, Any] = dict(name=record["name"], frozen_dtype=record["frozen_dtype"], teacher=record["teacher"])
        peak = node_sum(record, lambda r: r["step_peaks"]["uss"])
        if peak is None:
            rows.append({**row, "error": record.get("log_tail", "").strip().splitlines()[-1:]})
            continue
        ranks = record["ranks"]
        stored = sum(r["frozen_shard_bytes"] for r in ranks)
        in_flight = RANKS * ranks[0]["largest_module_params"] * COMPUTE_BYTES
        expected = stored + floor + in_flight if floor is not None else None
        row.update(node_peak=peak, frozen_stored=stored, floor=floor, in_flight=in_flight, expected=expected)
        row.update(ratio=ratio(peak, expected), load_peak=node_sum(record, lambda r: r["load_peaks"]["uss"]))
        row.update(frozen_params=ranks[0]["frozen_params"], step_s=max(r["step_s"] for r in ranks))
        if record["teacher"]:
            alone = next((x for x in rows if x["frozen_dtype"] == row["frozen_dtype"] and not x["teacher"]), {})
            row["teacher_measured"] = peak - alone["node_peak"] if "node_peak" in alone else None
            row["teacher_stored"] = stored - alone["frozen_stored"] if "frozen_stored" in alone else None
            # the teacher as a user loads it without the strategy: whole, in the compute dtype, on every rank
            row["teacher_outside_zero"] = RANKS * params["teacher"] * COMPUTE_BYTES
        rows.append(row)
    return rows


def write_results(results: dict, out: Path) -> None:
    write_json(out / "teacher_memory.json", results)
    meta, rows = results["meta"], results["rows"]
    params = meta["params"]
    header = [
        "configuration",
        "frozen stored (node)",
        "floor x 2",
        "2 layers in flight",
        "expected",
        "**node peak, steps**",
        "**peak / expected**",
        "load peak",
        "step s",
    ]
    body = []
    for row in rows:
        if "error" in row:
            body.append([row["name"], f"failed: {' '.join(row['error'])}", *[""] * (len(header) - 2)])
            continue
        cells = (row["frozen_stored"], row["floor"], row["in_flight"], row["expected"], row["node_peak"])
        body.append(
            [row["name"], *(mib(c, 0) for c in cells), f"**{num(row['ratio'])}x**", mib(row["load_peak"], 0)]
            + [num(row["step_s"], 1)]
        )
    teacher_rows = [
        [
            row["name"],
            mib(row["teacher_stored"], 0),
            mib(row["teacher_measured"], 0),
            num(ratio(row["teacher_measured"], row["teacher_stored"])),
            mib(row["teacher_outside_zero"], 0),
            num(ratio(row["teacher_outside_zero"], row["teacher_measured"]), 1),
        ]
        for row in rows
        if row["teacher"] and row.get("teacher_measured") is not None
    ]
    lines = [
        "# A frozen teacher twice the student's size: host memory on 2 CPU ranks",
        "",
        f"`python benchmarks/teacher_memory/run.py`, {meta['date']}, commit {meta['commit']}, {meta['cpu']}"
        f" ({meta['machine']}); load average {meta['load_before']} before, {meta['load_after']} after"
        f" ({meta['wall_s']:.0f} s). Student base {params['student']:,} params (PEFT LoRA r=8 on q/v), teacher"
        f" {params['teacher']:,} ({params['teacher'] / params['student']:.2f}x), Llama architecture, vocabulary"
        f" {LLAMA['vocab_size']:,}, both built with `from_pretrained` in `configure_model`; `32-true`, batch {BATCH}"
        f" x {SEQUENCE} tokens per rank, {meta['steps']} steps, loss = cross entropy + KL to the teacher. MiB."
        + (
            " glibc maps every buffer above 1 MiB (`MALLOC_MMAP_THRESHOLD_`), so the peaks follow live memory."
            if meta.get("mmap_1mib")
            else " Allocator as a user runs it (no setting in the environment)."
        ),
        "",
        "Node peak: the sum over the ranks of each rank's peak USS during the steps. Expected: the frozen params as"
        " stored (each rank's shards, codes and scales under NF4, summed) + the floor run's node peak (imports,"
        " process group and engine, no model) + per rank the module with the most params of its own, whole in fp32"
        f" (the {LLAMA['vocab_size']:,}-row embedding or head). Load peak: the node's peak up to the first step.",
        "",
        *table(header, body),
        "",
        "The teacher's cost: its frozen bytes as stored (node), the node peak with it minus the node peak without it,"
        " and the teacher loaded outside ZeRO as a user would without the strategy (whole, in fp32, on each of the 2"
        " ranks: arithmetic, not run).",
        "",
        *table(
            ["configuration", "teacher stored", "teacher measured", "measured / stored", "outside ZeRO", "÷ measured"],
            teacher_rows,
        ),
        "",
    ]
    (out / "teacher_memory.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=Path, metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--student", help=argparse.SUPPRESS)
    parser.add_argument("--teacher", help=argparse.SUPPRESS)
    parser.add_argument("--frozen-dtype", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help="training steps (the first is left out of step s)")
    parser.add_argument("--size", choices=tuple(SIZES), default="bench")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these configurations (floor included)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--mmap-1mib", action="store_true", help="glibc maps buffers above 1 MiB, so the peaks follow live memory"
    )
    parser.add_argument("--report", action="store_true", help="only rewrite teacher_memory.md from the json")
    args = parser.parse_args()
    if args.worker:
        sampler = PeakSampler(SAMPLE_SECONDS)
        sampler.start()
        args.run_dir = args.worker
        worker(args, sampler)
        return
    if args.report:
        results = read_json(args.out / "teacher_memory.json")
        results["rows"] = summarize(results["records"], results["meta"]["params"])
        write_results(results, args.out)
        print((args.out / "teacher_memory.md").read_text())
        return
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only or c[0] == "floor"]
    started, load_before = time.perf_counter(), load_average()
    with tempfile.TemporaryDirectory(prefix="teacher_memory_") as scratch:
        folders = {role: Path(scratch) / role for role in ("student", "teacher")}
        params = {role: write_llama(folders[role], SIZES[args.size][role], seed) for seed, role in enumerate(folders)}
        records = [run_one(config, folders, Path(scratch) / "runs", args) for config in configs]
    meta = dict(
        date=now_utc(),
        commit=git_commit(),
        cpu=cpu_model(),
        machine=machine(),
        versions=versions(),
        size=args.size,
        params=params,
        steps=args.steps,
        mmap_1mib=args.mmap_1mib,
        load_before=load_before,
        load_after=load_average(),
        wall_s=round(time.perf_counter() - started, 1),
    )
    results = {"meta": meta, "rows": summarize(records, params), "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(results, args.out)
    print((args.out / "teacher_memory.md").read_text())


if __name__ == "__main__":
    main()
