"""The peer a CPU user would run beside ``frozen_deepspeed``: transformers + PEFT in a plain training loop.

    python -m benchmarks.harness.plain_loop SPEC_JSON     # one run in this process (what :func:`run` starts)

:func:`run` starts one such run in a fresh process under ``launch.guarded_run`` and returns its figures. The spec:
``folder`` (a Hugging Face folder), ``lora`` (``LoraConfig`` arguments), ``nf4`` (load the base through bitsandbytes,
``BitsAndBytesConfig(load_in_4bit=True, nf4)``, else in fp32), ``sequence`` tokens per sequence, ``batch`` sequences
per step (1 unless given), ``warmup`` and ``steps``, ``threads`` (torch's default unless given), ``canary`` (the
kinds after each step, in turn: ``CanaryCycle``).
The run loads the base, wraps it in LoRA, and trains warm-up and timed steps (forward, backward, AdamW step) on
random tokens, fp32 compute, on all the machine's cores; a thread samples its USS every 0.05 s (peaks of the
load and of the training apart). It also records what
the frozen base holds, by dtype as stored, so a reader sees what bitsandbytes quantized and what it left as it was.

The driver side imports no torch: only the run's own process does.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import launch
from benchmarks.harness.probes import CanaryCycle, PeakSampler
from benchmarks.harness.records import read_json


def frozen_storage(model: Any) -> dict[str, Any]:
    """The frozen params' elements and bytes as stored, per dtype (bitsandbytes' packed uint8 counted with its
    absmax scales), and the bytes in all."""
    by_dtype: dict[str, dict[str, int]] = {}
    for param in model.parameters():
        if param.requires_grad:
            continue
        entry = by_dtype.setdefault(str(param.dtype).removeprefix("torch."), {"elements": 0, "bytes": 0})
        entry["elements"] += param.numel()
        entry["bytes"] += param.numel() * param.element_size()
        absmax = getattr(getattr(param, "quant_state", None), "absmax", None)
        if absmax is not None:
            entry["bytes"] += absmax.numel() * absmax.element_size()
    return {"by_dtype": by_dtype, "bytes": sum(entry["bytes"] for entry in by_dtype.values())}


def train(spec: dict[str, Any]) -> None:
    """One run of ``spec`` in this process; its figures to ``spec['out']``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    sampler = PeakSampler()
    sampler.start()
    started = time.perf_counter()
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if spec["nf4"]:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
    base = AutoModelForCausalLM.from_pretrained(spec["folder"], **kwargs)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **spec["lora"]))
    model.train()
    load_s = time.perf_counter() - started
    load_peak_uss = sampler.end_phase()["uss"]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(
        0,
        model.config.vocab_size,
        (spec["warmup"] + spec["steps"], spec.get("batch", 1), spec["sequence"]),
        generator=torch.Generator().manual_seed(0),
    )
    steps, canary, meter = [], [], CanaryCycle(spec.get("canary") or ["small"])
    for input_ids in tokens:
        begin = time.perf_counter()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - begin)
        canary.append(meter.sample())  # outside the step's time (probes.MachineCanary)
    sampler.stop()
    Path(spec["out"]).write_text(
        json.dumps(
            {
                "load_s": load_s,
                "steps_s": steps,
                "canary": canary,
                "load_peak_uss": load_peak_uss,
                "train_peak_uss": sampler.peaks()["uss"],
                "loss": float(loss.detach()),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "frozen": frozen_storage(model),
            }
        )
    )


def run(name: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run ``spec`` (without ``out``) in a fresh process under the harness's guard; return the row ``name``:
    ``status``, the median of the timed steps, every step's time, the peak USS, the load time and what :func:`train`
    recorded; or the status and the log's tail where the run failed."""
    with tempfile.TemporaryDirectory() as scratch:
        out, log = Path(scratch) / "plain_loop.json", Path(scratch) / "plain_loop.log"
        print(f"\n=== {name}", flush=True)
        command = [sys.executable, "-m", "benchmarks.harness.plain_loop", json.dumps(dict(spec, out=str(out)))]
        outcome = launch.guarded_run(command, launch.child_env(spec.get("threads")), log, timeout_s / 60)
        if launch.exit_status(outcome) != 0 or not out.exists():
            tail = log.read_text()[-3000:]
            print(tail, flush=True)
            return {"name": name, "status": outcome.get("reason") or f"exit {outcome['returncode']}", "log": tail}
        figures = read_json(out)
    return {
        "name": name,
        "status": "ok",
        "ranks": 1,
        "tokens_per_step": spec["sequence"] * spec.get("batch", 1),
        "units_per_step": spec["sequence"] * spec.get("batch", 1),
        "step_s": statistics.median(figures["steps_s"][spec["warmup"] :]),
        "peak_uss": max(figures["load_peak_uss"], figures["train_peak_uss"]),
        "load_peak_uss": figures["load_peak_uss"],
        "train_peak_uss": figures["train_peak_uss"],
        "load_s": figures["load_s"],
        "steps_s": figures["steps_s"],
        "canary": figures["canary"],
        "loss": figures["loss"],
        "trainable_params": figures["trainable"],
        "frozen": figures["frozen"],
    }


if __name__ == "__main__":
    train(json.loads(sys.argv[1]))
