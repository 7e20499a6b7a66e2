"""The figures of ``run.py``: one summary per run record, the merged results files, and the GPU arithmetic.

Memory figures are per node: the sum over ranks of each rank's peak (ranks peak at different moments, so this is an
upper bound of the simultaneous peak, which the driver's guard samples too: ``node_peak_anon_shmem``). "USS" is
the memory a rank alone maps (psutil's ``memory_full_info().uss``): unlike RSS it does not count the shared
libraries and shared pages of every rank again, so it adds up across ranks; it does count the pages of the
safetensors files a rank alone has mapped, which are page cache the kernel can reclaim, and the frozen codes the
ranks share on one machine (``zero/frozen_files.py``; every rank maps them, so each adds its own shards'
bytes). "anon" (``RssAnon``) is
the anonymous memory only: what the process itself allocated. Ratios are (node peak - node floor) / frozen bytes,
where the floor is each rank's memory after its imports, before the model is built, and the frozen bytes are the
ranks' frozen shards as stored (codes and scales when quantized) or the same params in bf16.

Imports nothing heavy at module level: the driver stays a light process.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness.records import read_json, write_json
from benchmarks.harness.tables import GIB, MIB, gib, mib, num

# goals of issue 17, reported as met/missed, never asserted
NF4_13B_NODE_PEAK_GIB = 9.0
BF16_7B_LOAD_RATIO = 1.10
FIRST_STEP_OVER_READ = 1.5
FINGERPRINT_SHARE = 0.10


def _node(ranks: list[dict], phase: str, kind: str) -> Optional[int]:
    values = [r.get(phase, {}).get(kind) for r in ranks]
    return sum(values) if values and all(v is not None for v in values) else None


def _ratio(value: Optional[int], floor: Optional[int], base: Optional[int]) -> Optional[float]:
    return round((value - floor) / base, 3) if value is not None and floor is not None and base else None


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run record (``run.py``'s ``run_config``); missing phases give None."""
    config, ranks = record["config"], record.get("ranks", [])
    rank0 = next((r for r in ranks if r.get("rank") == 0), {})
    errors = {
        f"rank {r['rank']} {phase}": text.strip().splitlines()[-1][:300]
        for r in ranks
        for phase, text in r.get("errors", {}).items()
    }
    outcome, resumed = record.get("outcome", {}), record.get("resume_outcome", {"status": "ok"})
    status, reason = outcome.get("status", "not run"), outcome.get("reason")
    complete = len(ranks) == config["devices"]
    if status == "ok" and (errors or not complete):
        status = "error"
    if status == "ok" and resumed["status"] != "ok":
        status, reason = f"resume {resumed['status']}", resumed.get("reason")
    summary: dict[str, Any] = {"status": status, "errors": errors, "reason": reason}
    frozen_params = rank0.get("frozen_params")
    storage = (
        sum(r["frozen_shard_bytes"] for r in ranks)
        if complete and all("frozen_shard_bytes" in r for r in ranks)
        else None
    )
    bf16 = 2 * frozen_params if frozen_params else None
    summary.update(
        frozen_params=frozen_params,
        trainable_params=rank0.get("trainable_params"),
        frozen_storage_bytes=storage,
        frozen_bf16_bytes=bf16,
        stored_as=rank0.get("frozen_stored_as"),
    )
    for kind in ("uss", "anon", "rss"):
        floor = _node(ranks, "floor", kind) if complete else None
        summary[f"floor_{kind}"] = floor
        # the resume runs in fresh processes with their own floor (older records: in the same process)
        resume_floor = (_node(ranks, "resume_floor", kind) if complete else None) or floor
        for phase in ("load", "train", "resume_load", "resume_train"):
            floor = resume_floor if phase.startswith("resume") else summary[f"floor_{kind}"]
            peak = _node(ranks, f"{phase}_peaks", kind) if complete else None
            summary[f"{phase}_peak_{kind}"] = peak
            summary[f"{phase}_{kind}_over_storage"] = _ratio(peak, floor, storage)
            summary[f"{phase}_{kind}_over_bf16"] = _ratio(peak, floor, bf16)
    for kind in ("uss", "anon"):  # the phase a stopped run was in: its ranks' peaks so far
        running = [r.get("resume_running_peaks", r.get("running_peaks", {})).get(kind) for r in ranks]
        summary[f"last_phase_peak_{kind}"] = sum(running) if running and all(running) else None
    read = record.get("cache", {}).get("plain_read", {})
    summary["plain_read_s"], summary["plain_read_mib_s"] = read.get("s"), read.get("mib_s")
    loads = [r.get("times", {}).get("from_pretrained_s") for r in ranks]
    if loads and all(loads):
        summary["from_pretrained_s"] = round(max(loads), 2)
        summary["load_mib_s"] = round(record["checkpoint"]["bytes"] / MIB / max(loads), 1)
    fingerprints = [r.get("fingerprint_s") for r in ranks]
    summary["fingerprint_s"] = max(f[0] for f in fingerprints) if fingerprints and all(fingerprints) else None
    summary["first_step_at_s"] = rank0.get("first_step_at")
    steps = rank0.get("step_s") or []
    if summary["first_step_at_s"] is not None and steps:
        summary["first_step_end_s"] = round(summary["first_step_at_s"] + steps[0], 2)
    started = rank0.get("times", {}).get("configure_model_at")
    summary["configure_model_at_s"] = round(started, 2) if started is not None else None
    if summary["first_step_at_s"] and read.get("s"):
        summary["first_step_over_read"] = round(summary["first_step_at_s"] / read["s"], 2)
        if started is not None:  # without the processes' start: load, engine setup, fingerprint
            summary["load_to_first_step_over_read"] = round((summary["first_step_at_s"] - started) / read["s"], 2)
    if summary["first_step_at_s"] and summary["fingerprint_s"] is not None:
        summary["fingerprint_share"] = round(summary["fingerprint_s"] / summary["first_step_at_s"], 3)
    per_rank = [r.get("step_s", [])[config["warmup"] :] for r in ranks]
    if per_rank and all(len(s) == config["steps"] for s in per_rank) and config["steps"]:
        step = max(statistics.median(s) for s in per_rank)
        summary["step_s"] = round(step, 3)
        summary["tokens_per_s"] = round(config["batch"] * config["sequence"] * config["devices"] / step, 1)
    summary["warmup_step_s"] = steps[0] if steps else None
    summary["losses"] = rank0.get("losses")
    summary["checkpoint_bytes"], summary["save_s"] = rank0.get("checkpoint_bytes"), rank0.get("save_s")
    summary["resumed_exactly"] = (
        all(r.get("resumed_exactly") for r in ranks)
        if complete and all("resumed_exactly" in r for r in ranks)
        else None
    )
    if summary["status"] == "ok" and summary["resumed_exactly"] is False:
        summary["status"] = "resume differs"
    summary["resumed_from_step"] = rank0.get("resumed_from_step")
    summary["resume_first_step_at_s"] = rank0.get("resume_first_step_at")
    return summary


def one_line(record: dict[str, Any]) -> str:
    s = record["summary"]
    parts = [record["key"], s["status"]]
    if s.get("load_peak_uss") is not None:
        parts.append(f"load peak {s['load_peak_uss'] / GIB:.2f} GiB USS ({s['load_uss_over_storage']}x storage)")
    if s.get("step_s"):
        parts.append(f"step {s['step_s']} s")
    if s.get("first_step_at_s"):
        parts.append(f"first step at {s['first_step_at_s']} s")
    parts += [f"{k}: {v}" for k, v in s["errors"].items()] + ([s["reason"]] if s.get("reason") else [])
    return " | ".join(parts)


# ------------------------------------------------------------------------------------------------ results files


def load_records(out: Path) -> list[dict[str, Any]]:
    path = out / "big_model.json"
    return read_json(path)["records"] if path.exists() else []


def done_keys(out: Path) -> set[str]:
    """Configurations with a successful record."""
    return {r["key"] for r in load_records(out) if r["summary"]["status"] == "ok"}


def merge(record: dict[str, Any], out: Path, arithmetic_rows: Callable[[], list[dict[str, Any]]]) -> None:
    """Append ``record`` to ``big_model.json`` and rewrite ``big_model.md``; ``arithmetic_rows`` is called when the
    file has no arithmetic yet."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "big_model.json"
    data = read_json(path) if path.exists() else {"records": []}
    data["records"].append(record)
    if "arithmetic" not in data:
        data["arithmetic"] = arithmetic_rows()
    write_json(path, data)
    write_markdown(out)


def _shown(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest record of each configuration, and before a failed one the latest that succeeded."""
    latest: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        latest.setdefault(record["key"], []).append(record)
    shown = []
    for runs in latest.values():
        ok = [r for r in runs if r["summary"]["status"] == "ok"]
        if runs[-1]["summary"]["status"] != "ok" and ok:
            shown.append(ok[-1])
        shown.append(runs[-1])
    return shown


def _goals(record: dict[str, Any]) -> list[str]:
    s, config = record["summary"], record["config"]
    found = []
    if config["size"] == "13b" and config["frozen_dtype"] == "nf4" and s.get("train_peak_uss") is not None:
        peak = max(s["load_peak_uss"], s["train_peak_uss"])
        found.append(
            f"13B NF4 node peak {peak / GIB:.2f} GiB (USS) ≤ {NF4_13B_NODE_PEAK_GIB}:"
            f" {'met' if peak <= NF4_13B_NODE_PEAK_GIB * GIB else 'missed'}"
        )
    if config["size"] == "7b" and config["frozen_dtype"] == "none" and s.get("load_uss_over_storage") is not None:
        ratio = s["load_uss_over_storage"]
        found.append(
            f"7B bf16 load ≤ {BF16_7B_LOAD_RATIO}x: {ratio} {'met' if ratio <= BF16_7B_LOAD_RATIO else 'missed'}"
        )
    if config["size"] in ("7b", "13b") and s.get("first_step_over_read") is not None:
        ratio = s["first_step_over_read"]
        found.append(
            f"first step ≤ {FIRST_STEP_OVER_READ}x read: {ratio} {'met' if ratio <= FIRST_STEP_OVER_READ else 'missed'}"
        )
    if config["size"] == "7b" and s.get("fingerprint_share") is not None:
        share = s["fingerprint_share"]
        found.append(
            f"fingerprint ≤ 10% of first step: {share:.1%} {'met' if share <= FINGERPRINT_SHARE else 'missed'}"
        )
    return found


def write_markdown(out: Path) -> None:
    """``big_model.md``: memory, time and goals of the latest record per configuration, then the arithmetic; the
    records' summaries in ``big_model.json`` are recomputed first."""
    data = read_json(out / "big_model.json")
    for record in data["records"]:  # the summaries derive from the raw figures: recomputed with this code
        record["summary"] = summarize(record)
    write_json(out / "big_model.json", data)
    shown = _shown(data["records"])
    lines = [
        "# LoRA on a Llama-2-shaped hub checkpoint, end to end on the CPU",
        "",
        "Written by `benchmarks/big_model/run.py` (see `benchmarks/README.md`); every run is in `big_model.json`, the"
        " latest of each configuration is shown. Config: size, frozen storage (`none` = the compute dtype), precision,"
        " ranks, tokens per sequence (batch 1 per rank). LoRA r=8 on `q_proj`/`v_proj`, AdamW, random tokens.",
        "",
        "## Memory (node: sum over ranks of each rank's peak)",
        "",
        "GiB. Floor: the ranks' memory after imports, before the model. Ratios: (peak − floor) / frozen bytes as"
        " stored, and / the same params in bf16. USS adds up across ranks (RSS would count shared pages per rank) and"
        " includes mapped safetensors pages; anon is what the processes allocated. Guard: the driver's own"
        " simultaneous sum of anonymous + shared memory over the run's processes.",
        "",
        "| config | status | frozen params | stored as | frozen GiB | floor USS | load USS | ÷ stored | ÷ bf16"
        " | load anon ÷ stored | train USS | ÷ stored | ÷ bf16 | train anon ÷ stored | guard peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in shown:
        s = record["summary"]
        params = f"{s['frozen_params'] / 1e9:.2f}B" if s.get("frozen_params") else ""
        lines.append(
            f"| {record['key']} | {s['status']} | {params} | {s.get('stored_as') or ''}"
            f" | {gib(s.get('frozen_storage_bytes'))} | {gib(s.get('floor_uss'))} | {gib(s.get('load_peak_uss'))}"
            f" | {num(s.get('load_uss_over_storage'), missing='')} | {num(s.get('load_uss_over_bf16'), missing='')}"
            f" | {num(s.get('load_anon_over_storage'), missing='')} | {gib(s.get('train_peak_uss'))}"
            f" | {num(s.get('train_uss_over_storage'), missing='')} | {num(s.get('train_uss_over_bf16'), missing='')}"
            f" | {num(s.get('train_anon_over_storage'), missing='')}"
            f" | {gib(record.get('outcome', {}).get('node_peak_anon_shmem'))} |"
        )
    lines += [
        "",
        "## Time",
        "",
        "Seconds on rank 0 from the `trainer.fit` call (so the first step includes starting rank 1's process; the"
        " next ratio starts at `configure_model` instead: load, engine setup and fingerprint only)."
        " Read: one sequential read of every shard file, page cache as `cache` says (cold: evicted before it and"
        " before the run). Load: `from_pretrained` (+ rate over the files' bytes). Step: median of the timed steps,"
        " worst rank; tokens/s over all ranks. Resume: a new Trainer from the checkpoint, one more step; `exact` ="
        " it started at the saved step and its adapter weights equal those saved.",
        "",
        "| config | date, commit | load avg | cache | read s (MiB/s) | load s (MiB/s) | fingerprint s | first step at"
        " | ÷ read | from `configure_model` ÷ read | step s | tokens/s | ckpt MiB | save s | resume |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in shown:
        s = record["summary"]
        cache = record.get("cache", {})
        resumed = {True: "exact", False: "NOT exact", None: ""}[s.get("resumed_exactly")]
        v = {key: "" if value is None else value for key, value in s.items()}
        read = f"{v['plain_read_s']} ({v['plain_read_mib_s']})" if s.get("plain_read_s") else ""
        load = f"{v['from_pretrained_s']} ({v['load_mib_s']})" if s.get("from_pretrained_s") else ""
        lines.append(
            f"| {record['key']} | {record['date']}, {record['commit']} | {record['load_average_at_start'][0]}"
            f" | {_cache(cache)} | {read} | {load} | {v['fingerprint_s']} | {v['first_step_at_s']}"
            f" | {v.get('first_step_over_read', '')} | {v.get('load_to_first_step_over_read', '')}"
            f" | {v.get('step_s', '')} | {v.get('tokens_per_s', '')} | {mib(s.get('checkpoint_bytes'))}"
            f" | {v['save_s']} | {resumed} |"
        )
    failures = [(r["key"], r["summary"]) for r in shown if r["summary"]["status"] != "ok"]
    goals = [(r["key"], g) for r in shown if r["summary"]["status"] == "ok" for g in _goals(r)]
    lines += ["", "## Goals (issue 17)", ""] + ([f"- {key}: {goal}" for key, goal in goals] or ["- none measured yet"])
    if failures:
        lines += ["", "## Failed or stopped", ""]
        lines += [
            f"- {key}: {s['status']}; {s.get('reason') or ''} {'; '.join(f'{k}: {v}' for k, v in s['errors'].items())}"
            + (
                " (peak of the phase it was in, summed over the ranks that reported:"
                f" {gib(s['last_phase_peak_uss'])} GiB USS,"
                f" {gib(s['last_phase_peak_anon'])} GiB anon)"
                if s.get("last_phase_peak_uss")
                else ""
            )
            for key, s in failures
        ]
    lines += ["", arithmetic_markdown(data.get("arithmetic") or arithmetic())]
    (out / "big_model.md").write_text("\n".join(lines) + "\n")


def _cache(cache: dict[str, Any]) -> str:
    """The page-cache mode and how much of the files was cached when the run started."""
    resident, total = cache.get("resident_before_run"), cache.get("files_bytes")
    return cache.get("mode", "") + (
        f", {resident / total:.0%} cached at start" if resident is not None and total else ""
    )


# ------------------------------------------------------------------------------------------------ GPU arithmetic


ARITHMETIC_SEQUENCE = 2048
ACTIVATION_BYTES_PER_LAYER_TOKEN_HIDDEN = 34  # one layer's activations in bf16 with flash attention (Korthikanti 2022)


def arithmetic() -> list[dict[str, Any]]:
    """What a GPU node would need for 13B and 70B (Llama-2 shapes, LoRA r=8 on q/v, bf16 compute), from
    ``lightning_frozen.estimate_memory`` (the physical limit: frozen bytes / N plus the trainable params' weight,
    master, moments and gradient): formulas, not measurements. One row per model, frozen storage and GPU count
    (one node)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.big_model.checkpoint import llama_config
    from benchmarks.big_model.worker import LORA
    from lightning_frozen import estimate_memory

    rows = []
    for size in ("13b", "70b"):
        config = llama_config(size)
        with torch.device("meta"):
            model = get_peft_model(LlamaForCausalLM(LlamaConfig(**config)), LoraConfig(**LORA))
        layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
        tokens = ARITHMETIC_SEQUENCE
        # activation checkpointing: each layer's bf16 input kept, one layer recomputed, fp32 logits and their grad
        activations = layers * 2 * tokens * hidden + ACTIVATION_BYTES_PER_LAYER_TOKEN_HIDDEN * tokens * hidden
        activations += 2 * 4 * tokens * vocab
        for storage in ("bf16", "int8", "nf4"):
            for gpus in (1, 2, 8):
                estimate = estimate_memory(
                    model,
                    num_devices=gpus,
                    precision="bf16-true",
                    print_table=False,
                    frozen_dtype=None if storage == "bf16" else storage,
                )
                frozen_node = estimate.frozen_shards * gpus
                rows.append(
                    dict(
                        size=size,
                        storage=storage,
                        gpus=gpus,
                        frozen_params=estimate.frozen_params,
                        trainable_params=estimate.trainable_params,
                        frozen_node_bytes=frozen_node,
                        load_in_flight_per_rank=estimate.load_in_flight,
                        host_load_quantizing_while_loading=frozen_node + gpus * estimate.load_in_flight,
                        host_load_package_estimate=estimate.host_load_bytes,
                        host_training_node=estimate.host_bytes * gpus,
                        gpu_offloaded=estimate.device_bytes,
                        gpu_not_offloaded=estimate.device_bytes + estimate.frozen_shards,
                        activations_per_gpu=activations,
                    )
                )
    return rows


def arithmetic_markdown(rows: list[dict[str, Any]]) -> str:
    """The arithmetic as a markdown section, labelled as such."""
    lines = [
        "## What a GPU machine would need: arithmetic, not measurement",
        "",
        "From `lightning_frozen.estimate_memory` (the physical limit and its scale arithmetic) on Llama-2 shapes"
        " built on the `meta` device, LoRA r=8 on q/v, bf16 compute, one node. GiB. Host at load: the frozen base as"
        " stored plus, per rank, what is in flight (the largest module `zero.Init` creates whole, one tensor's slice,"
        " the fp32 adapters) — when the loader quantizes while it reads; `estimate` is what the package's estimate"
        " says for the loader it has (it counts the shards in the compute dtype while loading). Per GPU: trainable"
        " states, the largest module gathered whole and the gradient bucket, with the frozen base offloaded to the"
        " host or kept on the GPUs (1/N each). Not included: each rank's runtime floor (CUDA context, libraries:"
        f" a few GiB of host memory per rank) and activations, shown apart for one {ARITHMETIC_SEQUENCE}-token"
        " sequence with activation checkpointing (each layer's bf16 input, one layer recomputed at 34 B per token"
        " and hidden unit, fp32 logits and their gradient).",
        "",
        "| model | frozen storage | GPUs | frozen base (node) | host at load, quantizing while loading | estimate"
        " | host while training | per GPU, base offloaded | per GPU, base on GPUs | + activations per GPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} ({r['frozen_params'] / 1e9:.1f}B) | {r['storage']} | {r['gpus']}"
            f" | {gib(r['frozen_node_bytes'])} | {gib(r['host_load_quantizing_while_loading'])}"
            f" | {gib(r['host_load_package_estimate'])} | {gib(r['host_training_node'])}"
            f" | {gib(r['gpu_offloaded'])} | {gib(r['gpu_not_offloaded'])} | {gib(r['activations_per_gpu'])} |"
        )
    return "\n".join(lines) + "\n"
