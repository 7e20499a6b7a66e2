"""``generate()`` in validation under ``frozen_deepspeed``: layer by layer against once per call, and one plain process.

    python benchmarks/generation/run.py [--size 1.1b|small] [--new-tokens 32] [--data-dir DIR] [--out DIR]

A Llama base written randomly once (``examples/causal_lm_lora/make_base.write_random_llama``; ``1.1b``: TinyLlama's
shape, hidden 2048, 22 layers, intermediate 5632, 32 heads, 4 KV heads, vocabulary 32000; bf16 safetensors), LoRA
r=8 on ``q_proj``/``v_proj`` (PEFT's ``init_lora_weights=False``, seeded: an adapter that changes the ids), fp32
compute. 8 prompts of 16 random tokens, greedy, exactly ``--new-tokens`` new tokens each:

- ``per layer``: ``frozen_deepspeed``, ``frozen_dtype="nf4"`` (``--frozen-dtype``; ``none``: fp32 shards), 2 ranks
  (one thread each), ``generation_memory=1``:
  ZeRO-3 gathers every layer for each new token;
- ``once per call``: the same with ``generation_memory="64GB"``: the model is gathered once when ``generate`` starts
  (its time is in the figure) and released after;
- ``plain``: transformers + PEFT in one process on all cores, the same folder loaded in fp32 (dense: no NF4), the
  same adapter.

Each rank generates for its 4 prompts in ``validation_step`` (``trainer.validate``; the sampler splits the 8), after a
warm-up ``generate`` of 1 new token. Time per generated token: the timed ``generate`` call's wall time (the slower
rank's) / new tokens per prompt (one decoding step for all prompts); per token of all prompts: / (8 x new tokens).
Each configuration runs under ``harness/launch.py``'s guard, which also measures the node's peak memory (the whole run,
load included). Writes ``<out>/generation_<frozen dtype>.json`` and ``<out>/generation_<frozen dtype>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from benchmarks.harness import launch, steadiness  # noqa: E402
from benchmarks.harness.probes import cpu_model, load_average, machine  # noqa: E402
from benchmarks.harness.records import git_commit, now_utc, versions, write_json  # noqa: E402
from benchmarks.harness.tables import gib, num, ratio, table  # noqa: E402

SIZES = {
    "1.1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    # a smoke test of the script
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
    ),
    # a quarter of the layers, for a machine where 1.1B does not fit the time
    "small": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=6,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}
PROMPTS, PROMPT_TOKENS, SEED = 8, 16, 11
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
MODES = (("per layer", "1"), ("once per call", "64GB"))


def prompts(vocab: int) -> Any:
    import torch

    return torch.randint(0, vocab, (PROMPTS, PROMPT_TOKENS), generator=torch.Generator().manual_seed(SEED))


def with_adapter(folder: str) -> Any:
    """The folder's model in fp32 with the seeded LoRA adapter (the same values in every process)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(SEED)
    return get_peft_model(base, LoraConfig(**LORA))


class TokenClock:
    """A stopping criterion that stops nothing: it notes the time each new token (one decoding step for all prompts)
    is ready, so the steadiness check sees every step of a ``generate`` call."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.ready: list[float] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.ready.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def __deepcopy__(self, memo: dict) -> TokenClock:
        return self  # transformers copies the criteria it is given; the times must land here

    def steps_s(self) -> list[float]:
        """Seconds of each decoding step, the first (the prompt's forward, and a gather once per call) first."""
        marks = [self.began, *self.ready]
        return [round(b - a, 4) for a, b in zip(marks, marks[1:])]


def timed_generate(model: Any, input_ids: Any, new_tokens: int) -> tuple[float, list, list[float]]:
    """A 1-token warm-up, then ``new_tokens`` greedy new tokens: the second call's seconds, ids and every decoding
    step's seconds."""
    import torch
    from transformers import StoppingCriteriaList

    options = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=input_ids, max_new_tokens=1, min_new_tokens=1, **options)
        started = time.perf_counter()
        clock = TokenClock()
        ids = model.generate(
            input_ids=input_ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            stopping_criteria=StoppingCriteriaList([clock]),
            **options,
        )
    return time.perf_counter() - started, ids.tolist(), clock.steps_s()


def ranks_worker(args: argparse.Namespace) -> None:
    """One 2-rank ``trainer.validate`` under ``frozen_deepspeed``; each rank writes ``<report>/rank<R>.json``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_frozen import FrozenAwareDeepSpeedStrategy

    class Generating(L.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = with_adapter(args.folder)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            seconds, ids, steps = timed_generate(self.model, batch[0], args.new_tokens)
            report = {"seconds": seconds, "ids": ids, "prompts": batch[0].tolist(), "threads": torch.get_num_threads()}
            report["steps_s"] = steps
            Path(args.report, f"rank{self.global_rank}.json").write_text(json.dumps(report))

    frozen_dtype = None if args.frozen_dtype == "none" else args.frozen_dtype
    strategy = FrozenAwareDeepSpeedStrategy(
        frozen_dtype=frozen_dtype, generation_memory=args.budget, fingerprint="none"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = DataLoader(TensorDataset(prompts(SIZES[args.size]["vocab_size"])), batch_size=PROMPTS // 2)
    trainer.validate(Generating(), data)


def plain_worker(args: argparse.Namespace) -> None:
    import torch

    model = with_adapter(args.folder).eval()
    seconds, ids, steps = timed_generate(model, prompts(SIZES[args.size]["vocab_size"]), args.new_tokens)
    report = {"seconds": seconds, "ids": ids, "threads": torch.get_num_threads(), "steps_s": steps}
    Path(args.report, "plain.json").write_text(json.dumps(report))


def run_config(args: argparse.Namespace, worker: str, report: Path, threads: int, *extra: str) -> dict[str, Any]:
    """Run ``worker`` in fresh processes under the harness's guard (``threads`` torch threads a process); return its
    outcome (wall time, the node's peak memory) with ``log``, what it printed (the strategy's notices among it)."""
    report.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, worker, f"--size={args.size}", f"--new-tokens={args.new_tokens}"]
    command.append(f"--frozen-dtype={args.frozen_dtype}")
    command += [f"--folder={args.folder}", f"--report={report}", *extra]
    log_path = report / f"{worker}.log"
    outcome = launch.guarded_run(command, launch.child_env(threads=threads), log_path, args.timeout_min)
    log = log_path.read_text()
    if launch.exit_status(outcome) != 0:
        raise SystemExit(f"{worker} {' '.join(extra)}: {outcome}\n{log[-6000:]}")
    return {**outcome, "log": log}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", nargs="?", default="all", choices=("all", "ranks", "plain"))
    parser.add_argument("--size", default="1.1b", choices=sorted(SIZES))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--frozen-dtype", default="nf4", choices=("nf4", "int8", "none"))
    parser.add_argument("--data-dir", default="/tmp/lightning-frozen-bench")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--folder", default=None)
    parser.add_argument("--report", default=None)
    parser.add_argument("--budget", default="1")
    parser.add_argument("--timeout-min", type=float, default=15)
    args = parser.parse_args()
    if args.command == "ranks":
        return ranks_worker(args)
    if args.command == "plain":
        return plain_worker(args)

    import torch

    from examples.causal_lm_lora.make_base import write_random_llama

    folder = Path(args.data_dir, f"llama-{args.size}")
    if not (folder / "config.json").exists():
        started = time.perf_counter()
        write_random_llama(folder, SIZES[args.size], torch.bfloat16)
        print(f"wrote {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    args.folder = str(folder)
    scratch = Path(args.data_dir, "reports")
    records: dict[str, Any] = {}
    load_before = load_average()
    for name, budget in MODES:
        started = time.perf_counter()
        report = scratch / name.replace(" ", "-")
        outcome = run_config(args, "ranks", report, 1, f"--budget={budget}")
        ranks = [json.loads((report / f"rank{rank}.json").read_text()) for rank in range(2)]
        notice = [line for line in outcome["log"].splitlines() if "generate() gathers" in line]
        records[name] = {
            "seconds": max(r["seconds"] for r in ranks),
            "rank_seconds": [r["seconds"] for r in ranks],
            "rank_steps_s": [r["steps_s"] for r in ranks],
            "threads_per_rank": ranks[0]["threads"],
            "notice": notice,
            "ids": [r["ids"] for r in ranks],
            "run_s": time.perf_counter() - started,
            "node_peak_anon_shmem": outcome["node_peak_anon_shmem"],
        }
        print(f"{name}: {records[name]['seconds']:.1f} s; {notice}", flush=True)
    started = time.perf_counter()
    outcome = run_config(args, "plain", scratch, os.cpu_count() or 1)
    plain = json.loads((scratch / "plain.json").read_text())
    records["plain"] = {
        "seconds": plain["seconds"],
        "threads": plain["threads"],
        "steps_s": plain["steps_s"],
        "run_s": time.perf_counter() - started,
    }
    records["plain"]["node_peak_anon_shmem"] = outcome["node_peak_anon_shmem"]
    print(f"plain: {plain['seconds']:.1f} s", flush=True)
    write_results(args, records, load_before)


def steadiness_rows(records: dict[str, Any], new_tokens: int) -> list[dict[str, Any]]:
    """The three modes as the steadiness check's rows: every decoding step, per token of all prompts."""
    rows = []
    for name in ("per layer", "once per call", "plain"):
        record = records[name]
        steps = [max(each) for each in zip(*record["rank_steps_s"])] if "rank_steps_s" in record else record["steps_s"]
        rows.append(dict(name=name, status="ok", steps_s=steps, timed=new_tokens - 1, units_per_step=PROMPTS))
    return rows


def write_results(args: argparse.Namespace, records: dict[str, Any], load_before: Any) -> None:
    same_ids = records["per layer"]["ids"] == records["once per call"]["ids"]
    cpu = cpu_model()
    result = {
        "date": now_utc(),
        "commit": git_commit(),
        "cpu": cpu,
        "machine": machine(),
        "versions": versions(),
        "size": args.size,
        "frozen_dtype": args.frozen_dtype,
        "config": SIZES[args.size],
        "prompts": PROMPTS,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.new_tokens,
        "load_average": {"before": load_before, "after": load_average()},
        "same_ids_in_both_modes": same_ids,
        "records": {name: {k: v for k, v in record.items() if k != "ids"} for name, record in records.items()},
    }
    plain, once = records["plain"]["seconds"], records["once per call"]["seconds"]
    rows = []
    for name in ("per layer", "once per call", "plain"):
        seconds = records[name]["seconds"]
        step_ms = 1000 * seconds / args.new_tokens
        token_ms = step_ms / PROMPTS
        peak = gib(records[name]["node_peak_anon_shmem"])
        rows.append([name, num(seconds, 2), num(step_ms, 0), num(token_ms, 1), num(ratio(seconds, plain), 2), peak])
    lines = [
        f"# generate() in validation: {args.size}, frozen_dtype {args.frozen_dtype}, LoRA, 2 ranks",
        "",
        f"{result['date']}, commit {result['commit']}, {cpu} ({result['machine']}),"
        f" load average {load_before} before, {result['load_average']['after']} after.",
        f"{PROMPTS} prompts of {PROMPT_TOKENS} tokens, {args.new_tokens} new tokens each, greedy, fp32 compute;"
        " ranks: 4 prompts and 1 thread each; plain: 8 prompts in one process on all cores, dense fp32 weights."
        " Node peak: anonymous + shared memory of the run's processes over the whole run (load included).",
        "",
        *table(["mode", "generate s", "ms / new token (8 prompts)", "ms / token", "x plain", "node peak GiB"], rows),
        "",
        f"Per layer / once per call: {num(ratio(records['per layer']['seconds'], once))}x."
        f" Ids equal in both modes: {same_ids}.",
        "",
        "## Every decoding step (issue 53's steadiness check)",
        "",
        "A step: one new token for every prompt (the ranks: the slower rank's); the first (the prompts' forward, and"
        " the gather once per call) is left out of the spread. The floor is `plain` (dense fp32, one process).",
        "",
        *steadiness.round_lines([steadiness_rows(records, args.new_tokens)], "plain", None),
        "Notices:",
        *[f"- {line}" for name in ("per layer", "once per call") for line in records[name]["notice"]],
        "",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"generation_{args.frozen_dtype}.json", result)
    (out / f"generation_{args.frozen_dtype}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
