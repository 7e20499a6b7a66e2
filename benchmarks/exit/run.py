"""Exit study: do 2-rank CPU runs end with every rank's status 0 and no "terminate called", with the exit hook as it
was (the default gloo group destroyed, nothing more) and as it is (destroyed, then gloo's workers idle)? (~15 min)

    flock /tmp/two_rank.lock python benchmarks/exit/run.py [--repeats N] [--adversarial N] [--out DIR]

Per hook, model (a tiny Llama and a tiny mT5, LoRA, written with ``save_pretrained``) and load (idle, or beside two
busy-loop processes that take both cores), ``--repeats`` times: a fit and save on 2 ranks (simulated nodes, so that
each rank's exit status is its own), then a resume of that checkpoint on 1 rank. Then ``--adversarial`` runs of
``tests/scripts/gloo_exit.py`` per hook: collectives left in flight at exit. The hooks alternate run by run, so both
meet the same machine. Writes ``results/results.json`` (every run) and ``results/results.md`` (the counts).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.harness.probes import load_average, machine  # noqa: E402
from benchmarks.harness.records import git_commit, host, now_utc, versions, write_json  # noqa: E402
from benchmarks.harness.tables import table  # noqa: E402
from tests.distributed import launch  # noqa: E402

FIT = Path(__file__).parent / "fit.py"
RESULTS = Path(__file__).parent / "results"
HOOKS = ("destroy-only", "package")
MODELS = ("llama", "mt5")
LOADS = ("idle", "loaded")


@contextmanager
def cores_loaded(load: str) -> Iterator[None]:
    """Two busy-loop processes (one per core of this machine) while the block runs, when ``load`` says so."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if load == "loaded" else 0)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def outcome(kind: str, hook: str, codes: list[int], outputs: list[str], seconds: float, **extra: Any) -> dict:
    return {
        "kind": kind,
        "hook": hook,
        "statuses": codes,
        "terminate_lines": sum(output.count("terminate called") for output in outputs),
        "seconds": round(seconds, 1),
        "load_average": load_average(),
        **extra,
    }


def fit_and_resume(bases: Path, work: Path, hook: str, model: str, load: str) -> list[dict]:
    checkpoint = work / f"{model}.ckpt"
    checkpoint.unlink(missing_ok=True)
    common = [f"--model={model}", f"--folder={bases / model}", f"--exit-hook={hook}"]
    with cores_loaded(load):
        fit = launch(FIT, *common, f"--save={checkpoint}", nodes=2, timeout=600)
        resume = launch(FIT, *common, f"--resume={checkpoint}", "--max-steps=4", "--num-nodes=1", timeout=600)
    return [
        outcome("fit 2 ranks + save", hook, *fit, model=model, load=load),
        outcome("resume 1 rank", hook, *resume, model=model, load=load),
    ]


def adversarial(work: Path, hook: str) -> dict:
    folder = Path(tempfile.mkdtemp(dir=work))
    result = launch("gloo_exit.py", f"--dir={folder}", f"--exit-hook={hook}", nodes=2, timeout=600)
    return outcome("collectives in flight at exit (gloo_exit.py)", hook, *result, model="adapter", load="idle")


def summary(runs: list[dict]) -> list[list[Any]]:
    rows = []
    keys = sorted({(r["kind"], r["model"], r["load"]) for r in runs}, key=lambda k: (k[0].startswith("coll"), k))
    for kind, model, load in keys:
        for hook in HOOKS:
            mine = [r for r in runs if (r["kind"], r["model"], r["load"], r["hook"]) == (kind, model, load, hook)]
            if not mine:
                continue
            statuses = [status for r in mine for status in r["statuses"]]
            bad = [status for status in statuses if status != 0]
            signals = f" ({', '.join(sorted({str(status) for status in bad}))})" if bad else ""
            rows.append(
                [
                    kind,
                    model,
                    load,
                    hook,
                    len(mine),
                    sum(any(status != 0 for status in r["statuses"]) for r in mine),
                    f"{len(bad)} of {len(statuses)}{signals}",
                    sum(r["terminate_lines"] for r in mine),
                ]
            )
    return rows


def write_results(out: Path, runs: list[dict], meta: dict) -> None:
    write_json(out / "results.json", {**meta, "runs": runs})
    header = ["run", "model", "cores", "exit hook", "runs", "runs with a failed rank", "ranks not 0", "terminate lines"]
    lines = [
        "# Exit study: 2-rank CPU runs, exit statuses and `terminate called` lines",
        "",
        f"{meta['date']}, commit {meta['commit']}, {meta['cpu']} ({meta['machine']}; {meta['host']}).",
        f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}.",
        "",
        "`destroy-only`: the exit hook as it was (torch's default gloo group destroyed at exit, nothing more).",
        "`package`: as it is (the groups destroyed through `deepspeed.comm`, then a wait until gloo's workers are",
        "idle). `loaded`: two busy-loop processes took both cores during the run. Negative statuses are signals",
        "(-6: SIGABRT).",
        "",
        *table(header, summary(runs)),
        "",
    ]
    (out / "results.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5, help="fit + resume runs per hook, model and load")
    parser.add_argument("--adversarial", type=int, default=10, help="gloo_exit.py runs per hook")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    meta = {
        "date": now_utc(),
        "commit": git_commit(),
        "cpu": cpu,
        "machine": machine(),
        "host": host(),
        "versions": versions(),
    }
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        subprocess.run([sys.executable, str(FIT), f"--write-bases={work / 'bases'}"], check=True, capture_output=True)
        for repeat in range(args.repeats):
            for model in MODELS:
                for load in LOADS:
                    for hook in HOOKS:
                        runs += fit_and_resume(work / "bases", work, hook, model, load)
                        print(repeat, runs[-2:], flush=True)
            write_results(args.out, runs, meta)
        for repeat in range(args.adversarial):
            for hook in HOOKS:
                runs.append(adversarial(work, hook))
                print(repeat, runs[-1], flush=True)
    write_results(args.out, runs, meta)


if __name__ == "__main__":
    main()
