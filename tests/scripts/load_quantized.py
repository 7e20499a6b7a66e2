"""Fit LoRA (with ``modules_to_save=["lm_head"]`` and a trainable final norm) over a ``save_pretrained`` Llama
loaded in ``configure_model`` with ``frozen_dtype`` on N CPU processes: quantized while loading (the default) or, with
``--after``, loaded in the compute dtype and quantized at setup. Each rank writes ``<report>/rank<R>.json``: the
sha256 of each frozen param's codes, the fingerprint, whether each trainable param holds the file's values, and the
lines Lightning and this package logged on that rank. ``--then`` starts the arguments of a next run in the same world
(a Trainer of its own), which saves starting the processes again."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy, progress  # noqa: E402
from lightning_frozen.base import (
    fingerprint,  # noqa: E402
    pretrained,  # noqa: E402
)
from tests.distributed import logged_lines, runs_of, write_report  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import PretrainedLoRA, folder_tensors, token_data  # noqa: E402


class LoRAWithTrainedHead(PretrainedLoRA):
    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.hparams.folder)
        trained_base = not self.hparams.get("lora_only")
        modules_to_save = ["lm_head"] if trained_base else None
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save)
        self.model = get_peft_model(base, config)
        if trained_base:
            self.model.base_model.model.model.norm.weight.requires_grad_(True)  # a base param the user trains

    def on_train_start(self) -> None:
        self.seen_at_start = held(self)


def file_key(name: str) -> str:
    for part in (".modules_to_save.default", ".original_module", ".base_layer"):
        name = name.replace(part, "")
    return name.removeprefix("model.base_model.model.")


def held(module: Any) -> dict[str, Any]:
    import deepspeed

    reference = folder_tensors(Path(module.hparams.folder))
    codes, exact = {}, {}
    for name, param in module.named_parameters():
        if param.requires_grad and "lora_" not in name:
            with deepspeed.zero.GatheredParameters([param]):
                exact[name] = torch.equal(
                    param.detach().cpu().to(reference[file_key(name)].dtype), reference[file_key(name)]
                )
        elif not param.requires_grad:
            codes[name] = [
                str(param.ds_tensor.dtype),
                hashlib.sha256(param.ds_tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
            ]
    strategy = module.trainer.strategy
    named = fingerprint.named_frozen(module)
    return {
        "codes": codes,
        "trainable_exact": exact,
        "fingerprint": strategy.frozen_base_fingerprint()["digest"],
        "quantized_at_load": strategy._loaded_base.quantized_at_load,
        # a pass over the shards, without the loader's record (when they hold values, not codes)
        "fingerprint_by_a_pass": None
        if strategy.frozen_dtype
        else fingerprint.fingerprint_base(named, strategy.fingerprint)["digest"],
        "fingerprinted": len(named),
    }


def main() -> None:
    for arguments in runs_of(sys.argv[1:]):
        run(arguments)


def run(arguments: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--frozen-dtype")
    parser.add_argument("--after", action="store_true")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--fingerprint", default="checksum")
    parser.add_argument("--lora-only", action="store_true", help="no modules_to_save, no trainable norm")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument(
        "--max-epochs", type=int, help="instead of --max-steps (a resume continues from an epoch's end)"
    )
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--report", required=True)
    parser.add_argument("--log-every", type=float, help="seconds between progress lines (default: the package's)")
    args = parser.parse_args(arguments)
    # the tests run this on one rank in their own process: the patches below are put back when it returns
    interval, creation = progress.INTERVAL_SECONDS, pretrained.sharded_model_creation
    try:
        with logged_lines() as lines:
            trainer, model = fit(args, creation)
        report = {"global_step": trainer.global_step, **model.seen_at_start, "logged": lines.lines}
        write_report(Path(args.report), trainer.global_rank, report)
        torch.distributed.barrier()
    finally:
        progress.INTERVAL_SECONDS, pretrained.sharded_model_creation = interval, creation


def fit(args: argparse.Namespace, creation: Any) -> tuple[Any, LoRAWithTrainedHead]:
    if args.log_every is not None:
        progress.INTERVAL_SECONDS = args.log_every
    if args.after:  # the loader stores compute-dtype shards; setup quantizes them (the path of bases loaded otherwise)

        def without_quantizing(config: dict, remote_device: Any, plan: Any) -> Any:
            return creation(config, remote_device, dataclasses.replace(plan, frozen_dtype=None))

        pretrained.sharded_model_creation = without_quantizing
    torch.manual_seed(0)  # LoRA A starts random: the same in every run
    model = LoRAWithTrainedHead(args.folder)
    model.hparams["lora_only"] = args.lora_only
    strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype=args.frozen_dtype, fingerprint=args.fingerprint)
    trainer = cpu_trainer(
        strategy,
        devices=args.devices,
        max_steps=-1 if args.max_epochs else args.max_steps,
        max_epochs=args.max_epochs or -1,
        precision=args.precision,
    )
    trainer.fit(model, token_data(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    return trainer, model


if __name__ == "__main__":
    main()
