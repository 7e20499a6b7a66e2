"""LoRA on a Qwen3-MoE-shaped base on the CPU: ``frozen_deepspeed`` beside the plain transformers + PEFT loop.

    python benchmarks/moe/run.py [--size 1.7b] [--steps 4] [--warmup 1] [--data-dir /work/bench-data] [--out DIR]
    python benchmarks/moe/run.py --size tiny --out /tmp/moe_trial      # every configuration on a tiny model
    python benchmarks/moe/run.py write --size 1.7b                     # only write (or reuse) the folder
    python benchmarks/moe/run.py --size small --threads 1              # 1 torch thread a process: a shared machine

The base is written once, offline, with random weights (``Qwen3MoeForCausalLM`` built from a ``Qwen3MoeConfig`` and
``save_pretrained`` in bf16 safetensors: each expert's tensors apart, as transformers stores them; it fuses them into
``mlp.experts.gate_up_proj`` / ``down_proj`` at load) under ``--data-dir``, and reused while its shape is the same.
``--size 1.7b``: hidden 1024, 16 layers, 64 experts of intermediate size 512, top-8 routing, a 32,000-token
vocabulary (Qwen's 151,936 would put 0.3B params in the embedding and the head alone); ``tiny`` checks the plumbing.
The run prints the parameter counts: in all, in the experts, and active per token.

Two LoRA variants (r=8), each through every configuration, one at a time, in fresh processes, 64 random tokens per
sequence and step, fp32 compute, AdamW:
- ``attention``: LoRA on ``q_proj``/``v_proj``;
- ``experts``: LoRA on the fused experts themselves, ``target_parameters=["mlp.experts.gate_up_proj",
  "mlp.experts.down_proj"]`` (PEFT's ParamWrapper; the names of transformers 5's Qwen3-MoE module).

Configurations:
- ``plain``: transformers + PEFT, the base loaded in fp32, a plain loop (``benchmarks/harness/plain_loop.py``);
- ``plain + bnb NF4``: the same with ``BitsAndBytesConfig(load_in_4bit=True, nf4)``. bitsandbytes quantizes
  ``nn.Linear`` layers only: the fused experts (plain params), the router and the head stay fp32, as recorded;
- ``ours fp32`` / ``ours NF4``: ``frozen_deepspeed`` with ``frozen_dtype=None`` / ``"nf4"``, 1 rank, through
  ``benchmarks/big_model/run.py``'s command line (``from_pretrained`` + ``get_peft_model`` in ``configure_model``);
- ``ours fp32 2r`` / ``ours NF4 2r``: the same on 2 ranks (one core and one sequence each), then a save and a resume
  in fresh processes.

Step: median wall time of the timed steps (every step's time is kept in ``moe.json``); ratios are of the time per
token (step / tokens per step over all ranks) to the plain loop's. Memory: the node's peak USS (summed over its
processes) over load and training, and over training alone, sampled in each process, as a user's processes hold it
(no allocator variables), to the plain loop's; the training peak also to the physical limit: the frozen base's bytes
as the run stores it plus 16 B per trainable param (fp32 weight, gradient, two Adam moments). Writes
``<out>/moe.json`` and ``<out>/moe.md``; big_model's records of our runs go to ``<out>/moe_ours/``.

The driver imports no torch: the folder is written, and every configuration runs, in processes of their own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from benchmarks.harness import launch, plain_loop  # noqa: E402
from benchmarks.harness.probes import cpu_model, load_average, machine  # noqa: E402
from benchmarks.harness.records import git_commit, now_utc, read_json, versions, write_json  # noqa: E402
from benchmarks.harness.tables import gib, mib, num, ratio, table  # noqa: E402

BIG_MODEL = HERE.parent / "big_model" / "run.py"
MARKER = ".moe_complete.json"

# Qwen3MoeConfig fields; every layer sparse (Qwen3-MoE's decoder_sparse_step=1), untied head, as Qwen3-30B-A3B
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=1000,
    ),
    # the 1.7b shape with 6 layers and 32 experts, top-4: the same share of experts runs per token (1/8); minutes
    "small": dict(
        hidden_size=1024,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        vocab_size=32000,
    ),
    "1.7b": dict(
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        vocab_size=32000,
    ),
}
SEQUENCE = 64
BYTES_PER_TRAINABLE = 16  # fp32 weight + gradient + two Adam moments: the least a trainable param needs
LORA_COMMON = dict(r=8, lora_alpha=16, lora_dropout=0.0)
LORAS: dict[str, dict[str, Any]] = {
    "attention": dict(LORA_COMMON, target_modules=["q_proj", "v_proj"]),
    "experts": dict(
        LORA_COMMON, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    ),
}
PLAIN = (("plain", False), ("plain + bnb NF4", True))
# name, frozen_dtype, ranks, and whether each MoE layer's experts are decoded whole (the path before issue 51's item 4)
OURS = (
    ("ours fp32", "none", 1, False),
    ("ours NF4, experts decoded whole", "nf4", 1, True),
    ("ours NF4", "nf4", 1, False),
    ("ours fp32 2r", "none", 2, False),
    ("ours NF4 2r", "nf4", 2, False),
)


def counts(shape: dict[str, int]) -> dict[str, int]:
    """Parameters of a Qwen3-MoE model of ``shape``: in all, in the experts, and active per token (all but the
    experts the router does not pick; the embedding table counted whole, as model cards count it)."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    query, key_value = (
        shape["num_attention_heads"] * shape["head_dim"],
        shape["num_key_value_heads"] * shape["head_dim"],
    )
    attention = 2 * hidden * query + 2 * hidden * key_value + 2 * shape["head_dim"]  # q, o, k, v, q_norm, k_norm
    expert = 3 * hidden * shape["moe_intermediate_size"]  # gate, up, down
    dense_per_layer = attention + shape["num_experts"] * hidden + 2 * hidden  # + router + two norms
    outside_layers = 2 * shape["vocab_size"] * hidden + hidden  # embedding, head, final norm
    experts = layers * shape["num_experts"] * expert
    return {
        "total": layers * dense_per_layer + experts + outside_layers,
        "experts": experts,
        "active": layers * (dense_per_layer + shape["num_experts_per_tok"] * expert) + outside_layers,
        "per_expert": expert,
    }


def write_folder(size: str, folder: Path) -> None:
    """Write the random-weight bf16 folder of ``size`` (or keep it, when its marker says the same shape)."""
    marker = folder / MARKER
    if marker.exists() and read_json(marker) == SIZES[size]:
        print(f"{folder}: written before, kept", flush=True)
        return
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: the whole model in fp32 would be twice the bytes
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SIZES[size], tie_word_embeddings=False))
    built = sum(p.numel() for p in model.parameters())
    expected = counts(SIZES[size])["total"]
    if built != expected:
        raise SystemExit(f"Qwen3MoeForCausalLM has {built:,} params, counts() says {expected:,}: fix counts()")
    model.save_pretrained(folder)
    write_json(marker, SIZES[size])
    print(f"{folder}: written, {built:,} params", flush=True)


def run_ours(
    name: str, lora: str, frozen_dtype: str, devices: int, experts_whole: bool, folder: Path, args: argparse.Namespace
) -> dict[str, Any]:
    out = args.out / "moe_ours"
    results = out / "big_model.json"
    before = len(read_json(results)["records"]) if results.exists() else 0
    command = [
        *(sys.executable, str(BIG_MODEL), "run", "--folder", str(folder), "--lora", json.dumps(LORAS[lora])),
        *("--label", f"lora-{lora}", "--frozen-dtype", frozen_dtype, "--precision", "32-true"),
        *("--devices", str(devices), "--sequence", str(SEQUENCE), "--warmup", str(args.warmup)),
        *("--steps", str(args.steps), "--data-dir", str(args.data_dir), "--out", str(out)),
        *("--timeout-min", str(args.timeout * devices / 60)),
        *(() if devices > 1 else ("--no-resume",)),  # save and resume peaks on 2 ranks; 1 rank stops after the save
        *(("--profile",) if args.profile else ()),
        *(("--experts-whole",) if experts_whole else ()),
        *(("--threads", str(args.threads)) if args.threads else ()),
    ]
    print(f"\n=== {lora}: {name}", flush=True)
    # big_model's driver guards its own processes (timeout, memory) and records why it stopped one
    subprocess.run(command, env=launch.child_env())
    records = read_json(results)["records"] if results.exists() else []
    if len(records) == before:
        return {"name": name, "lora": lora, "status": "big_model/run.py recorded nothing (see its output above)"}
    record = records[-1]
    summary = record["summary"]
    row = {"name": name, "lora": lora, "status": summary["status"], "reason": summary.get("reason")}
    if summary["status"] != "ok":
        return dict(row, errors=summary.get("errors"), log=record.get("log_tail"))
    ranks = record["ranks"]
    saves = [r.get("save_peaks", {}).get("uss") for r in ranks]
    return dict(
        row,
        ranks=devices,
        tokens_per_step=SEQUENCE * devices,
        step_s=summary["step_s"],
        steps_s=[r.get("step_s") for r in ranks],
        peak_uss=_most(summary["load_peak_uss"], summary["train_peak_uss"]),
        load_peak_uss=summary["load_peak_uss"],
        train_peak_uss=summary["train_peak_uss"],
        frozen_bytes=summary["frozen_storage_bytes"],
        stored_as=summary["stored_as"],
        trainable_params=summary["trainable_params"],
        losses=summary["losses"],
        save_peak_uss=sum(saves) if all(saves) else None,
        save_s=summary["save_s"],
        checkpoint_bytes=summary["checkpoint_bytes"],
        resume_peak_uss=_most(summary["resume_load_peak_uss"], summary["resume_train_peak_uss"]),
        resumed_exactly=summary["resumed_exactly"],
        profile=[{"profile": r.get("profile"), "floors": r.get("profile_floors")} for r in ranks if r.get("profile")],
    )


def run_plain(name: str, lora: str, nf4: bool, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    spec = dict(folder=str(folder), lora=LORAS[lora], nf4=nf4, sequence=SEQUENCE, warmup=args.warmup, steps=args.steps)
    if args.threads:
        spec["threads"] = args.threads
    row = plain_loop.run(f"{lora}: {name}", spec, args.timeout)
    if row["status"] == "ok":
        row.update(frozen_bytes=row["frozen"]["bytes"], stored_as=_stored(row["frozen"]["by_dtype"]))
    return dict(row, name=name, lora=lora)


def _most(*values: Optional[int]) -> Optional[int]:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _stored(by_dtype: dict[str, dict[str, int]]) -> str:
    """What the plain loop's frozen base holds: params per dtype (bitsandbytes' uint8 holds 2 NF4 params a byte)."""
    parts = []
    for dtype, entry in sorted(by_dtype.items()):
        params = entry["elements"] * (2 if dtype == "uint8" else 1)
        parts.append(f"{params / 1e6:,.1f}M {'NF4' if dtype == 'uint8' else dtype}")
    return ", ".join(parts)


def limit_bytes(row: dict[str, Any]) -> Optional[int]:
    """The physical limit of a run: its frozen base as stored + ``BYTES_PER_TRAINABLE`` per trainable param."""
    if row.get("frozen_bytes") is None or row.get("trainable_params") is None:
        return None
    return row["frozen_bytes"] + BYTES_PER_TRAINABLE * row["trainable_params"]


def report(result: dict[str, Any]) -> str:
    shape, count = result["shape"], result["counts"]
    lines = [
        f"# LoRA on a Qwen3-MoE-shaped base ({result['size']}): `frozen_deepspeed` beside the plain loop",
        "",
        f"Written by `benchmarks/moe/run.py` on {result['date']}, commit {result['commit']}, on {result['cpu']}"
        f" ({result['machine']}; load average {result['load_before']} before, {result['load_after']} after)."
        f" {SEQUENCE} random tokens per sequence, one sequence per rank and step, fp32 compute, LoRA r=8, AdamW;"
        f" {result['warmup']} warm-up and {result['steps']} timed steps"
        + (f", {result['threads']} torch thread(s) per process." if result.get("threads") else "."),
        "",
        f"Model: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_experts']} experts of"
        f" intermediate size {shape['moe_intermediate_size']}, top-{shape['num_experts_per_tok']}, vocabulary"
        f" {shape['vocab_size']}: {count['total']:,} params in all, {count['experts']:,} in the experts"
        f" ({count['experts'] / count['total']:.0%}), {count['active']:,} active per token.",
        "",
    ]
    for lora in LORAS:
        rows = [r for r in result["rows"] if r["lora"] == lora]
        if not rows:
            continue
        plain = next((r for r in rows if r["name"] == "plain" and r["status"] == "ok"), {})
        plain_per_token = plain["step_s"] / plain["tokens_per_step"] if plain else None
        body = []
        for row in rows:
            if row["status"] != "ok":
                # the first rank's error, else why the guard stopped the run: the whole of each is in moe.json
                why = next(iter((row.get("errors") or {}).values()), None) or row.get("reason") or ""
                body.append([row["name"], "", f"{row['status']}: {why[:200]}", *[""] * 9])
                continue
            limit = limit_bytes(row)
            body.append(
                [
                    row["name"],
                    row["ranks"],
                    num(row["step_s"]),
                    num(ratio(row["step_s"] / row["tokens_per_step"], plain_per_token)),
                    gib(row["peak_uss"]),
                    num(ratio(row["peak_uss"], plain.get("peak_uss"))),
                    gib(row["train_peak_uss"]),
                    num(ratio(row["train_peak_uss"], plain.get("train_peak_uss"))),
                    gib(limit),
                    num(ratio(row["train_peak_uss"], limit)),
                    f"{row['trainable_params']:,}",
                    row["stored_as"],
                ]
            )
        header = [
            "run",
            "ranks",
            "median step s",
            "per token ÷ plain",
            "peak USS GiB (node)",
            "÷ plain",
            "training peak GiB",
            "÷ plain",
            "physical limit GiB",
            "training peak ÷ limit",
            "trainable",
            "frozen base stored as",
        ]
        lines += [f"## LoRA on the {lora}: `{json.dumps(LORAS[lora])}`", "", *table(header, body), ""]
        resumed = [r for r in rows if r["status"] == "ok" and r.get("resumed_exactly") is not None]
        if resumed:
            header = ["run", "train peak GiB", "save peak GiB", "save s", "checkpoint MiB", "resume peak GiB", "exact"]
            body = [
                [
                    r["name"],
                    gib(r["peak_uss"]),
                    gib(r["save_peak_uss"]),
                    num(r["save_s"]),
                    mib(r["checkpoint_bytes"]),
                    gib(r["resume_peak_uss"]),
                    r["resumed_exactly"],
                ]
                for r in resumed
            ]
            lines += ["Save and resume (node peak USS of each phase; the resume in fresh processes):", ""]
            lines += [*table(header, body), ""]
    lines += [
        "Memory is the node's peak USS over load and training, and over training alone (from the first step; ours:"
        " from `on_train_start`); the physical limit is the frozen base's bytes as that run stores it plus"
        f" {BYTES_PER_TRAINABLE} B per trainable param. bitsandbytes quantizes `nn.Linear` layers"
        " only: the fused experts (`mlp.experts.gate_up_proj` / `down_proj` are params of `Qwen3MoeExperts`, not"
        " linear layers), the router (`Qwen3MoeTopKRouter`) and the head stay fp32, as the last column shows. Every"
        " step's time is in `moe.json`.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("run", "write"), default="run")
    parser.add_argument("--size", choices=list(SIZES), default="1.7b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads per process (default: torch's, ours: cores / ranks); 1 on a shared"
        " machine, so that a step's time is its own thread's",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per configuration (x ranks for ours)")
    parser.add_argument("--lora", nargs="+", choices=list(LORAS), default=list(LORAS))
    parser.add_argument("--only", nargs="+", help="run only these configurations (e.g. 'plain' 'ours NF4')")
    parser.add_argument(
        "--profile", action="store_true", help="ours: profile the last timed step (big_model/step_profile.py)"
    )
    parser.add_argument("--data-dir", type=Path, default=Path("/work/bench-data"))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    folder = args.data_dir / f"qwen3-moe-{args.size}"
    if args.command == "write":
        write_folder(args.size, folder)
        return
    count = counts(SIZES[args.size])
    print(
        f"Qwen3-MoE {args.size}: {count['total']:,} params, {count['experts']:,} in the experts,"
        f" {count['active']:,} active per token",
        flush=True,
    )
    write = [sys.executable, __file__, "write", "--size", args.size, "--data-dir", str(args.data_dir)]
    subprocess.run(write, check=True, env=launch.child_env())
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = load_average()[0]
    rows = []
    for lora in args.lora:
        for name, nf4 in PLAIN:
            if not args.only or name in args.only:
                rows.append(run_plain(name, lora, nf4, folder, args))
        for name, frozen_dtype, devices, experts_whole in OURS:
            if not args.only or name in args.only:
                rows.append(run_ours(name, lora, frozen_dtype, devices, experts_whole, folder, args))
    result = {
        "date": now_utc(),
        "commit": git_commit(),
        "versions": versions(),
        "cpu": cpu_model(),
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average()[0],
        "size": args.size,
        "shape": SIZES[args.size],
        "counts": count,
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": args.threads,
        "rows": rows,
    }
    write_json(args.out / "moe.json", result)
    (args.out / "moe.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
