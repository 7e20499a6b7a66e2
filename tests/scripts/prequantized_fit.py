"""A LoRA fit on a folder bitsandbytes saved as 4-bit nf4, under ``frozen_deepspeed`` on N CPU processes (also imported
by tests/test_prequantized.py for its in-process runs). Each rank writes ``<report>/rank<R>.json``: for each weight of
the folder's, its blocks that lie whole in the rank's shard and whether their codes are the folder's, its scales the
folder's absmax rounded up to fp16, and the weights in use bitsandbytes' dequantization within 2^-10 of themselves; the
same for the blocks a shard boundary cuts (against NF4's own error); the fingerprint, the losses and whether LoRA B
trained. ``--reference`` is a ``torch.save`` of bitsandbytes' own dequantization of every weight and of its absmax
(:func:`bitsandbytes_reference`, made where bitsandbytes is installed). ``--then`` starts a next run in the same world.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from tests.distributed import runs_of, write_report  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import TINY_LLAMA, PretrainedLoRA, plain_name, token_data  # noqa: E402

STATE = ".quant_state.bitsandbytes__nf4"


def bitsandbytes_folder(folder: Path, double_quant: bool, **config: Any) -> Path:
    """A random tiny Llama (``TINY_LLAMA`` updated with ``config``), fp32, quantized by bitsandbytes on the CPU as
    ``load_in_4bit`` nf4 and written with ``save_pretrained``: the folder a user downloads."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from examples.causal_lm_lora.make_base import write_random_llama

    write_random_llama(folder.with_name(folder.name + "-unquantized"), {**TINY_LLAMA, **config}, torch.float32)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder.with_name(folder.name + "-unquantized"), quantization_config=quantization, dtype=torch.float32
    )
    model.save_pretrained(folder)
    return folder


def bitsandbytes_reference(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """bitsandbytes' own dequantization of each weight it stored in ``folder`` (fp32) and its blocks' absmax."""
    from bitsandbytes import functional
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    reference = {}
    for state_key in [key for key in tensors if key.endswith(STATE)]:
        key = state_key.removesuffix(STATE)
        parts = {k: v for k, v in tensors.items() if k.startswith(key + ".")}
        state = functional.QuantState.from_dict(parts, device=torch.device("cpu"))
        absmax = state.absmax
        if state.nested:
            absmax = functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        values = functional.dequantize_4bit(tensors[key], state).float()
        reference[key] = {"values": values, "absmax": absmax.float(), "codes": tensors[key].reshape(-1)}
    return reference


class PrequantizedLoRA(PretrainedLoRA):
    """LoRA on q/v of a pre-quantized folder, loaded in ``configure_model`` as a QLoRA user does (``with_config``: with
    a ``BitsAndBytesConfig(load_in_4bit, nf4)`` in the call, as code written for an unquantized folder has). Records
    each step's loss, and at the start of training :func:`held` against ``reference``."""

    def __init__(self, folder: str, lr: float = 1e-2, with_config: bool = False, reference: str = "") -> None:
        super().__init__(folder, lr)
        self.save_hyperparameters()
        self.losses: list[float] = []

    def load_base(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        kwargs: dict[str, Any] = {}
        if self.hparams.with_config:
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
        return AutoModelForCausalLM.from_pretrained(self.hparams.folder, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_start(self) -> None:
        if self.hparams.reference:
            self.seen_at_start = held(self, torch.load(self.hparams.reference, weights_only=True))


def held(module: Any, reference: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Per weight bitsandbytes stored: this rank's whole blocks and cut ones, whether the whole ones' codes are the
    folder's and their scales its absmax rounded up to fp16, the largest error of the weights in use against
    bitsandbytes' dequantization (relative, whole blocks; in block absmax, cut ones); and the fingerprint."""
    import deepspeed

    from lightning_frozen.format import codec
    from lightning_frozen.zero.params import shard_range

    found = {}
    for name, param in module.named_parameters():
        key = plain_name(name.removeprefix("model."))
        key = key if key in reference else plain_name(name)
        if key not in reference:
            continue
        start, count = shard_range(param)
        with deepspeed.zero.GatheredParameters([param]):
            used = param.detach().reshape(-1)[start : start + count].float().clone()
        codes, scales = codec.split(param.ds_tensor.detach(), "nf4")
        want = reference[key]
        # the folder's blocks that are also blocks of this shard: none where the shard starts inside one
        first, end = start // 64, start + count
        last = -(-end // 64) if end == want["values"].numel() else end // 64
        last = last if start % 64 == 0 else first
        local, whole, blocks = slice(0, (last - first) * 32), slice(first * 32, last * 32), slice(0, last - first)
        expected = want["values"].reshape(-1)[start:end]
        inside = slice(0, min(count, (last - first) * 64))
        error = (used - expected).abs()
        cut = torch.ones(count, dtype=torch.bool)
        cut[inside] = False
        absmax = want["absmax"].repeat_interleave(64)[start : start + count]
        found[key] = {
            "whole_blocks": last - first,
            "cut_weights": int(cut.sum()),
            "codes_kept": bool(torch.equal(codes[local], want["codes"][whole])),
            "scales_rounded_up": bool(torch.equal(scales[blocks], rounded_up_to_fp16(want["absmax"][first:last]))),
            "relative_error": float((error[inside] / expected[inside].abs().clamp_min(1e-30)).max())
            if last > first
            else 0.0,
            "cut_error_in_absmax": float((error[cut] / absmax[cut]).max()) if bool(cut.any()) else 0.0,
        }
    return {"weights": found, "fingerprint": module.trainer.strategy.frozen_base_fingerprint()["digest"]}


def rounded_up_to_fp16(absmax: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value at least ``absmax``, each."""
    nearest = absmax.half()
    return torch.where(nearest.float() < absmax, torch.nextafter(nearest, torch.tensor(math.inf).half()), nearest)


def main() -> None:
    for arguments in runs_of(sys.argv[1:]):
        run(arguments)


def run(arguments: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--reference", default="")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--with-config", action="store_true")
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--report", required=True)
    args = parser.parse_args(arguments)

    torch.manual_seed(0)
    model = PrequantizedLoRA(args.folder, with_config=args.with_config, reference=args.reference)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(), devices=args.devices, max_steps=args.max_steps, max_epochs=-1)
    trainer.fit(model, token_data(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    report = {
        "global_step": trainer.global_step,
        "losses": model.losses,
        "frozen_dtype": trainer.strategy.frozen_dtype,
        "bitsandbytes_importable": importlib.util.find_spec("bitsandbytes") is not None,
        **json.loads(json.dumps(model.seen_at_start)),
    }
    write_report(Path(args.report), trainer.global_rank, report)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
