"""A plain torch model's run, in this fresh process: which modules of transformers and PEFT the package imports when
its strategy is built, and after a 1-rank CPU fit, written to ``<report>`` as JSON. Lightning itself imports
transformers' top level where it is installed (torchmetrics' text metrics do), so what counts is what appears after
``import lightning.pytorch``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch  # noqa: E402, F401

HF = ("transformers", "peft")


def hf_modules() -> set[str]:
    return {name for name in sys.modules if name.split(".")[0] in HF}


def main() -> None:
    report, lightning_own = Path(sys.argv[1]), hf_modules()
    from lightning_frozen import FrozenAwareDeepSpeedStrategy
    from tests.models import AdapterModel, cpu_trainer, regression_data

    imported = hf_modules() - lightning_own
    strategy = FrozenAwareDeepSpeedStrategy()
    built = hf_modules() - lightning_own
    cpu_trainer(strategy=strategy, max_steps=2).fit(AdapterModel(), regression_data())
    fitted = hf_modules() - lightning_own
    report.write_text(json.dumps(dict(imported=sorted(imported), built=sorted(built), fitted=sorted(fitted))))


if __name__ == "__main__":
    main()
