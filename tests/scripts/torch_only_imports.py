"""Plain torch models' runs, in this fresh process, then one whose ``configure_model`` is the first to import PEFT;
written to ``<report>`` as JSON.

- Which modules of transformers, PEFT and bitsandbytes the package imports when its strategy is built, after a 1-rank
  CPU fit of a module built in ``__init__``, and after one of a module that builds its layers in ``configure_model``
  (Lightning's pattern for big models). Lightning itself imports transformers' top level where it is installed
  (torchmetrics' text metrics do), so what counts is what appears after ``import lightning.pytorch``.
- Then a ``configure_model`` that imports PEFT itself and adapts a torch model: PEFT's LoRA weights as it built them
  (B zeros, whole tensors, not ZeRO-3 placeholders), transformers told that ZeRO-3 is on there, and after the run
  PEFT's and transformers' classes and functions their own again.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch  # noqa: E402, F401

HF = ("transformers", "peft", "bitsandbytes")


def hf_modules() -> set[str]:
    return {name for name in sys.modules if name.split(".")[0] in HF}


def watching() -> list[str]:
    """The package's import watches still in ``sys.meta_path`` (``base/pretrained.once_imported``)."""
    return [type(finder).__name__ for finder in sys.meta_path if "lightning_frozen" in type(finder).__module__]


def main() -> None:
    import torch
    from torch import nn

    from lightning_frozen import FrozenAwareDeepSpeedStrategy
    from tests.models import AdapterModel, LoRALinear, cpu_trainer, regression_data

    class BuiltInConfigureModel(AdapterModel):
        """The adapter model's layers built in ``configure_model``, under ``zero.Init``."""

        def __init__(self) -> None:
            super().__init__()
            del self.layers, self.head

        def configure_model(self) -> None:
            if not hasattr(self, "head"):
                self.layers = nn.ModuleList(LoRALinear(32, 4) for _ in range(2))
                self.head = nn.Linear(32, 1)

    class PeftFirstImportedHere(AdapterModel):
        """A torch model adapted by PEFT in ``configure_model``, which imports PEFT for the first time."""

        seen: dict[str, Any]

        def __init__(self) -> None:
            super().__init__()
            del self.layers, self.head
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if hasattr(self, "model"):
                return
            from peft import LoraConfig, get_peft_model
            from transformers.integrations import is_deepspeed_zero3_enabled

            base = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
            self.model = get_peft_model(base, LoraConfig(r=4, target_modules=["0", "2"]))
            lora_b = [p for name, p in self.model.named_parameters() if "lora_B" in name]
            self.seen = dict(
                lora_b=[[p.numel(), bool((p == 0).all())] for p in lora_b], zero3=is_deepspeed_zero3_enabled()
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.item())
            return loss

    report, lightning_own = Path(sys.argv[1]), hf_modules()
    imported = hf_modules() - lightning_own
    strategy = FrozenAwareDeepSpeedStrategy()
    built = hf_modules() - lightning_own
    cpu_trainer(strategy=strategy, max_steps=2).fit(AdapterModel(), regression_data())
    fitted = hf_modules() - lightning_own
    cpu_trainer(strategy=FrozenAwareDeepSpeedStrategy(), max_steps=2).fit(BuiltInConfigureModel(), regression_data())
    configured = hf_modules() - lightning_own
    watched = watching()

    module = PeftFirstImportedHere()
    cpu_trainer(strategy=FrozenAwareDeepSpeedStrategy(), max_steps=2).fit(module, regression_data())
    import peft
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import modeling_utils
    from transformers.integrations import is_deepspeed_zero3_enabled

    wrapped = [hasattr(method, "__wrapped__") for method in (peft.PeftModel.__init__, BaseTuner.inject_adapter)]
    report.write_text(
        json.dumps(
            dict(
                imported=sorted(imported),
                built=sorted(built),
                fitted=sorted(fitted),
                configured=sorted(configured),
                watching=watched,
                peft_first_imported=dict(
                    seen=module.seen,
                    trained=len(module.losses) == 2 and all(math.isfinite(loss) for loss in module.losses),
                    peft_wrapped=[*wrapped, "_old_init" in vars(peft.PeftModel)],
                    load_state_dict=[modeling_utils.load_state_dict.__module__, type(modeling_utils.load_state_dict)],
                    zero3_after=is_deepspeed_zero3_enabled(),
                    watching=watching(),
                ),
            ),
            default=str,
        )
    )


if __name__ == "__main__":
    main()
