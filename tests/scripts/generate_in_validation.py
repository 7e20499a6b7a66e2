"""LoRA on a Llama folder (``tests.pretrained_support``) trained on 2 CPU ranks, with ``generate()`` in
``validation_step``: rank 0 asks for 3 new tokens and rank 1 for 9, without ``synced_gpus`` (ranks that stop at
different lengths hang under ZeRO-3 unless generation is synced). The tests run it as a script.

With ``--teacher``, a frozen teacher Llama from that folder joins the module in ``configure_model`` and each training
step adds a distillation loss (KL to the teacher's next-token distribution) and computes a DPO-style reference: the
base with the adapter disabled (``disable_adapter`` under ``no_grad``), as TRL does with PEFT.

With ``--count-gathers``, validation also generates 3 and then 9 new tokens on both ranks and records, for each
call, how many ZeRO-3 all-gathers it started (``tests/gather_recording.py``) and the ids. ``--generation-memory`` and
``--frozen-dtype`` are the strategy's arguments (``none`` for None); ``--validate-only`` runs ``trainer.validate`` on
the adapter as PEFT creates it (``init_lora_weights=False``: random, seeded, so that it changes what is generated)
instead of ``fit``, once for each frozen dtype and budget of their comma-separated lists.

Each rank writes ``<report>/rank<R>.json``: its prompts, the ids generated with the adapter and with it disabled
(PEFT's ``disable_adapter``: the base alone), for each training step its input ids with the last position's
reference and teacher logits, and the counted calls. Rank 0 saves ``<report>/adapter.ckpt`` after fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.gather_recording import GatherRecorder  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import PretrainedLoRA, token_data  # noqa: E402

NEW_TOKENS = {0: 3, 1: 9}
COUNTED_TOKENS = (3, 9)
PROMPT = 4
ADAPTER_SEED = 11


class GeneratingLoRA(PretrainedLoRA):
    """Generates in validation, as a user checking samples would; records what each rank generated."""

    teacher_folder: str | None = None  # not a hyper-parameter: `load_from_checkpoint` builds the student alone
    random_adapter = False  # PEFT's `init_lora_weights=False`, seeded (`--validate-only`)
    recorder: GatherRecorder | None = None  # counts the all-gathers of the counted calls (`--count-gathers`)
    steps: list[dict[str, Any]]

    def configure_model(self) -> None:
        if self.random_adapter and not hasattr(self, "model"):
            build_with_random_adapter(self)
        super().configure_model()
        if self.teacher_folder and not hasattr(self, "teacher"):
            from transformers import AutoModelForCausalLM

            self.teacher = AutoModelForCausalLM.from_pretrained(self.teacher_folder).requires_grad_(False)
        self.steps = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.teacher_folder:
            return super().training_step(batch, batch_idx)
        ids = batch[0]
        logits = self.model(input_ids=ids).logits
        with torch.no_grad():
            with self.model.disable_adapter():  # the DPO reference: the base alone, no second model
                reference = self.model(input_ids=ids).logits
            teacher = self.teacher(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        distill = torch.nn.functional.kl_div(
            logits.float().log_softmax(-1), teacher.float().log_softmax(-1), log_target=True, reduction="batchmean"
        )
        last = {"ids": ids.tolist(), "reference": reference[:, -1].float().tolist()}
        self.steps.append({**last, "teacher": teacher[:, -1].float().tolist()})
        return loss + 0.1 * distill

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        prompts, new = batch[0][:, :PROMPT], NEW_TOKENS[self.global_rank]
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        ids = self.model.generate(input_ids=prompts, **options)
        self.generated = {"prompts": prompts.tolist(), "ids": ids.tolist()}
        with self.model.disable_adapter():
            self.generated["base_ids"] = self.model.generate(input_ids=prompts, **options).tolist()
        self.generated["counted"] = [] if self.recorder is None else [self.counted(prompts, n) for n in COUNTED_TOKENS]

    def counted(self, prompts: torch.Tensor, new: int) -> dict[str, Any]:
        """``new`` tokens generated on every rank, and the all-gathers the call started."""
        assert self.recorder is not None
        before = len(self.recorder.gathers)
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        ids = self.model.generate(input_ids=prompts, **options).tolist()
        return {"new": new, "gathers": len(self.recorder.gathers) - before, "ids": ids}


def build_with_random_adapter(module: GeneratingLoRA) -> None:
    """The module's base from its folder and a LoRA adapter on q/v whose A and B are both random, from a fixed seed:
    built so in the run (inside `configure_model`) and in one plain process alike."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(module.hparams.folder, dtype=torch.float32)  # as the run computes
    torch.manual_seed(ADAPTER_SEED)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    module.model = get_peft_model(base, config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--teacher", default=None)
    parser.add_argument("--generation-memory", default="auto")
    parser.add_argument("--frozen-dtype", default=None)
    parser.add_argument("--count-gathers", action="store_true")
    parser.add_argument("--validate-only", action="store_true")
    args = parser.parse_args()
    GeneratingLoRA.teacher_folder = args.teacher
    GeneratingLoRA.random_adapter = args.validate_only
    GeneratingLoRA.recorder = GatherRecorder() if args.count_gathers else None

    # with `--validate-only`, one `validate` per frozen dtype and budget of comma-separated lists, each with a Trainer
    # of its own, in one launch; its reports go to `<report>/<frozen dtype>-budget-<budget>/`
    frozen_dtypes = (args.frozen_dtype or "none").split(",") if args.validate_only else [args.frozen_dtype or "none"]
    budgets = args.generation_memory.split(",") if args.validate_only else [args.generation_memory]
    for frozen_dtype, budget in [(frozen_dtype, budget) for frozen_dtype in frozen_dtypes for budget in budgets]:
        torch.manual_seed(0)
        model = GeneratingLoRA(args.folder, lr=0.2)  # large steps: the adapter must change what greedy decoding picks
        memory = int(budget) if budget.isdigit() else budget
        stored = None if frozen_dtype == "none" else frozen_dtype
        strategy = FrozenAwareDeepSpeedStrategy(generation_memory=memory, frozen_dtype=stored)
        trainer = cpu_trainer(strategy, devices=2, max_epochs=4, check_val_every_n_epoch=4)
        report = Path(args.report)
        if args.validate_only:
            trainer.validate(model, token_data(samples=4, batch_size=2))
            model.steps, report = [], report / f"{frozen_dtype}-budget-{budget}"
            report.mkdir(exist_ok=True)
        else:
            trainer.fit(model, token_data(), token_data(samples=4, batch_size=2))
            trainer.save_checkpoint(report / "adapter.ckpt")
        results = {**model.generated, "steps": model.steps}
        (report / f"rank{trainer.global_rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
