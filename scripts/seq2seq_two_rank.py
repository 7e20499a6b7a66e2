"""The mT5 sequence-to-sequence LoRA scenario of ``scripts/repeat_two_rank.sh``: a LoRA fit of a tiny mT5 on 2 ranks
(20 steps at 32-true, each rank its own process, so that each exit status is its own), a resume of its checkpoint on
1 rank, then the PEFT export of the resumed checkpoint. Exits 1 with every process's output when a rank ends non-zero
or prints "terminate called", or the export lacks a file. Imports the checkout on ``PYTHONPATH``.

    PYTHONPATH=. python scripts/seq2seq_two_rank.py --work DIR     (DIR/mt5 holds the base, written once)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.exit.fit import Seq2SeqLoRA, write_mt5
from tests.distributed import launch, own_extensions_dir
from tests.models import cpu_trainer
from tests.pretrained_support import token_data


def node(base: Path, steps: int, nodes: int, save: Path, resume: str | None) -> None:
    """One rank of a run (``launch`` starts one process per simulated node)."""
    trainer = cpu_trainer(devices=1, num_nodes=nodes, max_steps=steps, max_epochs=-1, precision="32-true")
    trainer.fit(Seq2SeqLoRA(str(base)), token_data(), ckpt_path=resume)
    trainer.save_checkpoint(save)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--node", nargs=4, metavar=("STEPS", "NODES", "SAVE", "RESUME"), help="run as one rank")
    args = parser.parse_args()
    own_extensions_dir()  # DeepSpeed's ops in the suite's folder for this venv, not rebuilt after another venv's run
    base = args.work / "mt5"
    if args.node:
        steps, nodes, save, resume = args.node
        node(base, int(steps), int(nodes), Path(save), None if resume == "-" else resume)
        return
    if not (base / "config.json").exists():
        write_mt5(base)
    fit, resumed = args.work / "fit.ckpt", args.work / "resumed.ckpt"
    script, work = str(Path(__file__).resolve()), f"--work={args.work}"
    runs = {}
    runs["fit on 2 ranks"] = launch(script, work, "--node", "20", "2", str(fit), "-", nodes=2, timeout=600)
    if not any(runs["fit on 2 ranks"][0]):
        runs["resume on 1 rank"] = launch(script, work, "--node", "24", "1", str(resumed), str(fit), timeout=600)
    failed = [name for name, (codes, out, _) in runs.items() if any(codes) or "terminate called" in "".join(out)]
    for name, (codes, outputs, seconds) in runs.items():
        print(f"== {name}: statuses {codes}, {seconds:.0f} s")
        for output in outputs if name in failed else []:
            print(output)
    if failed or len(runs) < 2:
        sys.exit(1)
    from lightning_frozen import export_peft_adapter

    names = sorted(path.name for path in export_peft_adapter(resumed, args.work / "adapter").iterdir())
    print(f"== export: {names}")
    if not {"adapter_config.json", "adapter_model.safetensors"} <= set(names):
        sys.exit(1)


if __name__ == "__main__":
    main()
