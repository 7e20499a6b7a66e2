"""A scorer loaded in the LightningModule's ``setup()`` with ``from_pretrained`` and kept in a plain list, out of the
module tree, beside LoRA on a base that ``configure_model`` loads from the same folder, on N CPU processes. The scorer
scores every training and validation batch, as a reward model would.

Each rank writes ``<report>/rank<R>.json``: for each run (one per ``--frozen-dtypes`` entry, each a Trainer of its
own in one launch), which of the scorer's params are ZeRO-3 params, the input ids it scored and its scores, and how
the configure_model base is held at the start of training (``tests.pretrained_support.describe``) with how many of
its shards the loader stored as codes as it read them; and ``<report>/scorer-<dtype>-rank<R>.pt``, the scorer's
state dict.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import PretrainedLoRA, token_data  # noqa: E402


class ScoredLoRA(PretrainedLoRA):
    """LoRA trained on a base built in ``configure_model``; a scorer from the same folder loaded in ``setup()``."""

    def setup(self, stage: str) -> None:
        from transformers import AutoModelForCausalLM

        # a plain list: Lightning, DeepSpeed and the strategy never see it as part of the module
        self.scorers = [AutoModelForCausalLM.from_pretrained(self.hparams.folder).requires_grad_(False)]
        self.scored: list[dict[str, Any]] = []

    def score(self, ids: torch.Tensor) -> None:
        with torch.no_grad():
            logits = self.scorers[0](input_ids=ids).logits[:, -1]
        self.scored.append({"ids": ids.tolist(), "scores": logits.tolist()})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.score(batch[0])
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.score(batch[0])
        super().validation_step(batch, batch_idx)

    def on_train_start(self) -> None:
        super().on_train_start()
        self.seen_at_start["quantized_at_load"] = self.trainer.strategy._loaded_base.quantized_at_load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--frozen-dtypes", default="none")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for frozen_dtype in args.frozen_dtypes.split(","):
        torch.manual_seed(0)
        model = ScoredLoRA(args.folder)
        strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype=None if frozen_dtype == "none" else frozen_dtype)
        trainer = cpu_trainer(strategy, devices=2, max_steps=2, max_epochs=-1)
        trainer.fit(model, token_data(), token_data(samples=4, batch_size=2))
        scorer = model.scorers[0]
        report[frozen_dtype] = {
            "zero_params": [name for name, param in scorer.named_parameters() if hasattr(param, "ds_id")],
            "scored": model.scored,
            "configure_model_base": model.seen_at_start,
        }
        torch.save(scorer.state_dict(), Path(args.report) / f"scorer-{frozen_dtype}-rank{trainer.global_rank}.pt")
    write_report(Path(args.report), trainer.global_rank, report)


if __name__ == "__main__":
    main()
