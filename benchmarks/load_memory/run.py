"""Host memory of loading a pretrained causal LM and training LoRA on it, 2 CPU ranks, ``configure_model`` vs
``__init__``, ``frozen_deepspeed`` vs Lightning's stock ``DeepSpeedStrategy``.

Each configuration runs in fresh processes (Lightning starts rank 1 by re-running this script), on a
Llama-architecture model with random weights written with ``save_pretrained`` in bf16: ``large`` (245M params) and
``floor`` (5M params, the same architecture). A thread in each rank samples its unique memory (USS: the pages no
other process maps, psutil's ``memory_full_info().uss``) every 50 ms from process start through the load and a few
training steps. The figure, per configuration:

    (node peak(large) - node peak(floor)) / frozen bf16 bytes(large)
    node peak = sum over ranks of each rank's peak USS

1.0 is the base held once per node; "load" takes the peaks up to the first training step, "whole fit" to the end of
training. Also recorded: the same with anonymous memory only (``RssAnon``: USS without the safetensors file's pages
a rank has mapped), the wall time of the load (``from_pretrained`` + ``get_peft_model``, wherever it runs) and the
median training step after the first. Each configuration runs with each ``--allocators`` entry: ``user`` as a user
runs it (no allocator setting in the environment: what the package does itself is all there is), ``env`` with
``MALLOC_MMAP_THRESHOLD_=1048576`` (glibc maps every buffer above 1 MiB, so freed buffers leave the process and the
peaks follow live memory). ``--package DIR`` runs the workers on another checkout of the package (an earlier
commit, for before/after figures, written side by side under ``--label``).

    python benchmarks/load_memory/run.py     # ~15 min on 2 shared cores; writes results/load_memory.{md,json}
    python benchmarks/load_memory/run.py --only frozen:configure_model --package /tmp/before --label before
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import launch  # noqa: E402
from benchmarks.harness.probes import PeakSampler, load_average, machine  # noqa: E402
from benchmarks.harness.records import RankReport, now_utc, read_json, read_rank_reports, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
SAMPLE_SECONDS = 0.05
# 14 layers x 12,847,104 + 2 x 32,768,000 (untied embeddings and head) + 1,024 (final norm) = 245,396,480 params
MODELS = {
    "large": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=14, num_attention_heads=16, vocab_size=32000
    ),
    "floor": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4, vocab_size=18000),
}
# (strategy, where the model is built); stock's configure_model path is expected to fail, and is shown failing
CONFIGS = (("frozen", "configure_model"), ("frozen", "init"), ("stock", "init"), ("stock", "configure_model"))
SEQUENCE, BATCH, TOKENS = 32, 2, 1000
# whether each allocator setting sets glibc's mmap threshold to 1 MiB; "user" removes the caller's, if any
ALLOCATORS = {"user": False, "env": True}


def llama_config(sizes: dict[str, int]) -> dict[str, Any]:
    """The ``LlamaConfig`` arguments of a model of ``sizes``: full multi-head attention, untied embeddings."""
    return dict(**sizes, num_key_value_heads=sizes["num_attention_heads"], tie_word_embeddings=False)


def write_base(folder: Path, sizes: dict[str, int]) -> int:
    """Save a random-weight bf16 ``LlamaForCausalLM`` of ``sizes`` to ``folder``; return its parameter count."""
    from examples.causal_lm_lora.make_base import write_random_llama

    return sum(p.numel() for p in write_random_llama(folder, llama_config(sizes)).parameters())


# --------------------------------------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace, sampler: PeakSampler) -> None:
    """Fit LoRA on ``args.base`` for a few steps on 2 CPU ranks; each rank writes ``rank<N>.json`` to ``args.out``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_frozen
    from tests.stock_cpu import CPUDeepSpeedStrategy

    torch.set_num_threads(1)
    load_seconds: list[float] = []
    step_seconds: list[float] = []

    load_peaks: dict[str, int] = {}

    class EndOfLoad(L.Callback):
        def on_train_start(self, *args: Any) -> None:
            load_peaks.update(sampler.peaks())  # the model built and loaded, the engine set up, before a step

        def on_train_batch_start(self, *args: Any) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            step_seconds.append(time.perf_counter() - self.started)

    class LoRACausalLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if args.where == "init":
                self.model = self.load()

        def load(self) -> torch.nn.Module:
            from peft import LoraConfig, get_peft_model
            from transformers import AutoModelForCausalLM

            started = time.perf_counter()
            base = AutoModelForCausalLM.from_pretrained(args.base)
            model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
            load_seconds.append(time.perf_counter() - started)
            return model

        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = self.load()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (input_ids,) = batch
            return self.model(input_ids=input_ids, labels=input_ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    tokens = torch.randint(0, TOKENS, (BATCH * args.steps * 2, SEQUENCE), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens), batch_size=BATCH)
    # "frozen-nf4" quantizes while loading; "frozen-nf4-late" loads bf16 shards and quantizes them at setup, as a
    # base that arrives another way (a `.bin` file, converted keys) is
    frozen_dtype = args.strategy.split("-")[1] if args.strategy.startswith("frozen-") else None
    if args.strategy.endswith("-late"):
        creation = lightning_frozen.base.pretrained.sharded_model_creation

        def quantized_late(config: dict, remote_device: Any, plan: Any) -> Any:
            return creation(config, remote_device, dataclasses.replace(plan, frozen_dtype=None))

        lightning_frozen.base.pretrained.sharded_model_creation = quantized_late
    strategy = (
        lightning_frozen.FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype)
        if args.strategy.startswith("frozen")
        else CPUDeepSpeedStrategy(stage=3)
    )
    module = LoRACausalLM()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EndOfLoad()],
    )
    error: Optional[str] = None
    try:
        trainer.fit(module, data)
    except Exception as exception:  # the figure of a configuration that fails is its message
        error = f"{type(exception).__name__}: {str(exception).strip().splitlines()[0][:300]}"
    sampler.stop()
    frozen = sum(
        p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters() if not p.requires_grad
    )
    peaks = sampler.peaks()
    RankReport(Path(args.out)).update(
        peak_uss=peaks["uss"],
        peak_anon=peaks["anon"],
        **({"load_peak_uss": load_peaks["uss"], "load_peak_anon": load_peaks["anon"]} if load_peaks else {}),
        load_s=round(load_seconds[0], 2) if load_seconds else None,
        step_s=round(statistics.median(step_seconds[1:]), 3) if len(step_seconds) > 1 else None,
        frozen_params=frozen,
        steps=trainer.global_step,
        error=error,
    )


# --------------------------------------------------------------------------------------------------- the driver


def run_one(model: str, config: tuple[str, str, str], base: Path, scratch: Path, args: argparse.Namespace) -> dict:
    strategy, where, allocator = config
    out = scratch / f"{args.label}-{model}-{strategy}-{where}-{allocator}"
    out.mkdir(parents=True)
    command = [sys.executable, __file__, "--worker", strategy, where, str(base), str(out), "--steps", str(args.steps)]
    env = launch.child_env(threads=1, mmap_1mib=ALLOCATORS[allocator], package=args.package)
    if args.package:
        command += ["--package", str(args.package)]
    started, load_before = time.perf_counter(), load_average()
    outcome = launch.guarded_run(command, env, scratch / f"{out.name}.log", args.timeout / 60, reports_dir=out)
    returncode = launch.exit_status(outcome)
    ranks = read_rank_reports(out)
    record = dict(model=model, strategy=strategy, where=where, allocator=allocator, label=args.label)
    record.update(returncode=returncode, ranks=ranks)
    record.update(wall_s=round(time.perf_counter() - started, 1), load_before=load_before)
    if len(ranks) < 2:
        record["log_tail"] = (scratch / f"{out.name}.log").read_text()[-2000:]
    print(f"{out.name}: exit {returncode} in {record['wall_s']} s", flush=True)
    return record


def node_peak(record: dict, key: str) -> Optional[int]:
    """Sum over ranks of each rank's peak; None unless both ranks finished training."""
    ranks = record["ranks"]
    if len(ranks) != 2 or any(r["error"] for r in ranks):
        return None
    return sum(r[key] for r in ranks)


def _key(run: dict) -> tuple[str, str, str, str]:
    """(label, strategy, where, allocator); runs recorded before allocators were compared ran with ``env``."""
    return run.get("label", "this"), run["strategy"], run["where"], run.get("allocator", "env")


def summarize(runs: list[dict], params: dict[str, int]) -> list[dict]:
    """One row per configuration: node peaks, the ratio to the frozen bytes, load and step time, or the error."""
    frozen_bytes = params["large"] * 2
    rows = []
    for label, strategy, where, allocator in dict.fromkeys(_key(r) for r in runs):
        large, floor = (
            next((r for r in runs if r["model"] == m and _key(r) == (label, strategy, where, allocator)), None)
            for m in ("large", "floor")
        )
        row: dict[str, Any] = dict(label=label, strategy=strategy, where=where, allocator=allocator)
        errors = {r["error"] for r in (large or {}).get("ranks", []) if r["error"]}
        if large is None:
            row["error"] = "not run"
        elif errors or len(large["ranks"]) != 2:
            row["error"] = "; ".join(sorted(errors)) or f"exit {large['returncode']}, no rank reports"
        if "error" in row:
            rows.append(row)
            continue
        for key in ("load_peak_uss", "load_peak_anon", "peak_uss", "peak_anon"):
            peak = node_peak(large, key)
            base = node_peak(floor, key) if floor else None
            row[f"node_{key}"] = peak
            row[f"floor_{key}"] = base
            row[f"ratio_{key}"] = round((peak - base) / frozen_bytes, 2) if peak and base else None
        row["load_s"] = max(r["load_s"] for r in large["ranks"])
        steps = [r.get("step_s") for r in large["ranks"]]
        row["step_s"] = max(steps) if None not in steps else None
        row["wall_s"] = large["wall_s"]
        rows.append(row)
    return rows


def write_results(results: dict, out: Path) -> None:
    write_json(out / "load_memory.json", results)
    meta = results["meta"]
    mib = 2**20
    lines = [
        "# Host memory of loading a pretrained model: `configure_model` vs `__init__`",
        "",
        f"`python benchmarks/load_memory/run.py` on {meta['machine']}, {meta['date']}. Llama architecture, random"
        f" weights, bf16, written with `save_pretrained`: {meta['params']['large']:,} params"
        f" ({meta['frozen_bytes'] / mib:,.0f} MiB frozen in bf16), floor model {meta['params']['floor']:,} params."
        f" 2 CPU ranks (gloo), LoRA r=8 on `q_proj`/`v_proj`, {meta['steps']} training steps, `bf16-mixed`.",
        f" Load average (1, 5, 15 min) before the runs: {meta['load_before']}, after: {meta['load_after']}"
        " (2 cores shared with other work).",
        *(
            f" Rerun on {rerun['date']} (load average {rerun['load_before']}): {', '.join(rerun['configs'])}."
            for rerun in meta.get("reruns", [])
        ),
        "",
        "Figure: (node peak − floor) / frozen bytes; node peak = sum over ranks of each rank's peak USS, sampled every"
        " 50 ms from process start; floor = the same run on the floor model. 1.0 = the base held once per node."
        " **Load**: peaks up to the first training step (model built and loaded, engine set up, base fingerprinted)."
        " **Whole fit**: peaks to the end of training; on the CPU the accelerator's memory is host memory too, so"
        " this adds what a GPU run holds on the GPU (ZeRO-3 gathers the running modules' params whole; DeepSpeed's"
        " defaults, `stage3_max_live_parameters` and `stage3_max_reuse_distance` of 1e9, would let it keep up to 1e9"
        " of them gathered between uses, which `frozen_deepspeed` bounds on the CPU). `anon`: the same with anonymous"
        " memory only (USS also counts the pages of the safetensors file that a rank alone has mapped). **Allocator**:"
        " `user` as a user runs it, `env` with `MALLOC_MMAP_THRESHOLD_=1048576`. **Code**: the package this run used"
        " (`this`: the checkout the benchmark is in). **Step s**: median training step after the first, slower rank.",
        "",
        "| code | strategy | model built in | allocator | load: node peak USS | floor"
        " | **load: (peak − floor) / frozen** | anon | **whole fit: (peak − floor) / frozen** | anon | step s | load s"
        " | run s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        name = "stock `DeepSpeedStrategy` (stage 3)"
        if row["strategy"].startswith("frozen"):
            suffix = row["strategy"].removeprefix("frozen").replace("-late", ", quantized at setup").lstrip("-")
            name = "`frozen_deepspeed`" + (f" {suffix}" if suffix else "")
        where = f"`{row['where']}`" if row["where"] == "configure_model" else "`__init__`"
        head = f"| {row.get('label', 'this')} | {name} | {where} | {row.get('allocator', 'env')}"
        if "error" in row:
            lines.append(f"{head} | fails: {row['error']} | | | | | | | | |")
            continue
        lines.append(
            f"{head} | {row['node_load_peak_uss'] / mib:,.0f} MiB"
            f" | {row['floor_load_peak_uss'] / mib:,.0f} MiB | **{row['ratio_load_peak_uss']}**"
            f" | {row['ratio_load_peak_anon']} | **{row['ratio_peak_uss']}** | {row['ratio_peak_anon']}"
            f" | {row.get('step_s')} | {row['load_s']} | {row['wall_s']} |"
        )
    lines += [
        "",
        "Goals for `configure_model` under `frozen_deepspeed`: load at most 1.25; whole fit as a user runs it at most"
        " 2.0, with the step no more than 5% slower than before.",
        "",
    ]
    estimate = meta.get("estimate")
    if estimate:
        lines += [
            "`lightning_frozen.estimate_memory` for this model on 2 ranks:"
            f" {estimate['host_load_bytes'] / mib:,.0f} MiB of host memory per node for the load (the base once,"
            f" {estimate['frozen_shards'] * 2 / mib:,.0f} MiB, plus {estimate['load_in_flight'] / mib:,.1f} MiB in"
            " flight per rank), i.e."
            f" {estimate['host_load_bytes'] / meta['frozen_bytes']:.2f}x the frozen bytes.",
            "",
        ]
    lines += scaling_notes(results)
    (out / "load_memory.md").write_text("\n".join(lines) + "\n")


def scaling_notes(results: dict) -> list[str]:
    """How the measured figures carry over to more ranks, larger models, and 13B on one 8-GPU node."""
    rows = {(r["strategy"], r["where"]): r for r in results["rows"] if r.get("label", "this") == "this"}
    sharded, whole = rows.get(("frozen", "configure_model"), {}), rows.get(("frozen", "init"), {})
    ratio, init_ratio = sharded.get("ratio_load_peak_uss"), whole.get("ratio_load_peak_uss")
    if ratio is None or init_ratio is None:
        return []
    gib = 2**30
    base_13b = 13_015_864_320 * 2  # benchmarks/estimate_13b/run.py's Llama-2-13B shape, bf16
    in_flight_13b = (5120 * 32000 * 9 // 8) * 2 + 13_107_200 * 4  # embedding whole + its 1/8 slice + fp32 LoRA
    return [
        "## How it scales",
        "",
        "- `configure_model`: the ranks' shards add up to the base once, whatever the number of ranks N; on top,"
        " each rank holds what is in flight (`zero.Init` creates each module's own params whole before"
        " partitioning them, so the largest one, here the embedding; one tensor's slice read from the file;"
        " the adapters, whole). So the figure is about 1 + N x in-flight / frozen bytes: it grows with N by one"
        " embedding matrix per rank, and falls toward 1.0 as models grow (the embedding is a smaller share of a"
        f" larger model). Measured here: {ratio} at N=2.",
        "- `__init__`: every rank builds the whole model before ZeRO-3 partitions it, so the figure grows about"
        f" linearly with N: {init_ratio} at N=2, about {init_ratio / 2:.1f} per rank, so about"
        f" {init_ratio * 4:.0f} at N=8; the model size does not change the multiple.",
        f"- 13B (Llama-2-13B shape, LoRA r=16 on q/v) on one node with 8 GPUs: the base is {base_13b / gib:.1f} GiB"
        f" in bf16. `configure_model`: {base_13b / gib:.1f} GiB + 8 x {in_flight_13b / 2**20:,.0f} MiB in flight"
        f" = {(base_13b + 8 * in_flight_13b) / gib:.1f} GiB of host memory"
        " (`estimate_memory(..., num_devices=8).host_load_bytes`), plus each rank's runtime floor (CUDA context and"
        f" libraries); at the ratio measured here it would be {ratio * base_13b / gib:.0f} GiB. `__init__`: about"
        f" {init_ratio * 4 * base_13b / gib:.0f} GiB, beyond most nodes' memory.",
        "",
    ]


def estimate_load(sizes: dict[str, int], devices: int) -> dict:
    """``estimate_memory`` of the LoRA model the workers train, built on ``meta``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import lightning_frozen

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**llama_config(sizes)))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    return lightning_frozen.estimate_memory(
        model, num_devices=devices, precision="bf16-mixed", print_table=False
    ).as_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=4, metavar=("STRATEGY", "WHERE", "BASE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help="training steps after the load")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    parser.add_argument("--report", action="store_true", help="only rewrite load_memory.md from load_memory.json")
    parser.add_argument(
        "--only", nargs="+", metavar="STRATEGY:WHERE", help="rerun these configurations into load_memory.json"
    )
    parser.add_argument("--allocators", nargs="+", choices=tuple(ALLOCATORS), default=list(ALLOCATORS))
    parser.add_argument("--package", type=Path, help="the checkout of the package the workers import")
    parser.add_argument("--label", default="this", help="the name of --package's code in the table")
    args = parser.parse_args()
    sys.path.insert(0, str(args.package or HERE.parents[1]))
    if args.worker:
        sampler = PeakSampler(SAMPLE_SECONDS)
        sampler.start()
        args.strategy, args.where, args.base, args.out = args.worker
        worker(args, sampler)
        return
    if args.report:
        results = read_json(args.out / "load_memory.json")
        results["meta"]["estimate"] = estimate_load(MODELS["large"], devices=2)
        results["rows"] = summarize(results["runs"], results["meta"]["params"])
        write_results(results, args.out)
        print((args.out / "load_memory.md").read_text())
        return

    pairs = [tuple(config.split(":")) for config in args.only] if args.only else list(CONFIGS)
    configs = [(strategy, where, allocator) for strategy, where in pairs for allocator in args.allocators]
    started, load_before = time.perf_counter(), load_average()
    with tempfile.TemporaryDirectory(prefix="load_memory_") as scratch:
        scratch_path = Path(scratch)
        params = {name: write_base(scratch_path / name, sizes) for name, sizes in MODELS.items()}
        runs = [
            run_one(model, config, scratch_path / model, scratch_path / "runs", args)
            for config in configs
            for model in ("large", "floor")
            if not (config[:2] == ("stock", "configure_model") and model == "floor")
        ]
    meta = dict(
        date=now_utc(),
        machine=machine(),
        params=params,
        frozen_bytes=params["large"] * 2,
        steps=args.steps,
        load_before=load_before,
        load_after=load_average(),
        wall_s=round(time.perf_counter() - started, 1),
        estimate=estimate_load(MODELS["large"], devices=2),
    )
    if args.only:
        previous = read_json(args.out / "load_memory.json")
        for run in previous["runs"]:  # a run recorded without a label ran on the code of its own date
            run.setdefault("label", f"as of {previous['meta']['date']}")
        keys = {(args.label, *config) for config in configs}
        runs = [r for r in previous["runs"] if _key(r) not in keys] + runs
        rerun = dict(configs=[":".join((args.label, *c)) for c in configs], date=meta["date"], load_before=load_before)
        meta = {**previous["meta"], "reruns": [*previous["meta"].get("reruns", []), rerun]}
    results = {"meta": meta, "rows": summarize(runs, params), "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(results, args.out)
    print((args.out / "load_memory.md").read_text())


if __name__ == "__main__":
    main()
