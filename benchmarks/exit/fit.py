"""One run of the exit study: a LoRA fit on a tiny Llama or mT5 base (``save_pretrained`` folders that
``configure_model`` loads), then a save; or a resume of that checkpoint. Run it once per simulated node
(``--devices=1 --num-nodes=N`` with ``NODE_RANK``), as ``tests.distributed.launch`` does, so that each rank's exit
status is its own; ``--exit-hook=destroy-only`` puts back the exit hook as it was before it waited for gloo's workers.

    python benchmarks/exit/fit.py --write-bases DIR        (writes DIR/llama and DIR/mt5, then exits)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tests.distributed import destroy_only_at_exit, write_report  # noqa: E402
from tests.models import cpu_trainer  # noqa: E402
from tests.pretrained_support import VOCAB, PretrainedLoRA, token_data, write_llama  # noqa: E402

TINY_MT5 = dict(
    vocab_size=VOCAB,
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)


def write_mt5(folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A randomly initialised mT5 saved like a hub checkpoint (config.json + model.safetensors)."""
    from transformers import MT5Config, MT5ForConditionalGeneration

    torch.manual_seed(0)
    MT5ForConditionalGeneration(MT5Config(**TINY_MT5)).to(dtype).save_pretrained(folder)
    return folder


class Seq2SeqLoRA(PretrainedLoRA):
    """LoRA on q/v of a sequence-to-sequence model that ``configure_model`` loads from ``folder``."""

    lora_targets = ["q", "v"]

    def load_base(self) -> torch.nn.Module:
        from transformers import AutoModelForSeq2SeqLM

        return AutoModelForSeq2SeqLM.from_pretrained(self.hparams.folder)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).logits


MODELS = {"llama": PretrainedLoRA, "mt5": Seq2SeqLoRA}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write-bases", type=Path)
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--folder", help="the base's save_pretrained folder")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--resume")
    parser.add_argument("--save")
    parser.add_argument("--report")
    parser.add_argument("--exit-hook", choices=["package", "destroy-only"], default="package")
    args = parser.parse_args()
    if args.write_bases:
        write_llama(args.write_bases / "llama")
        write_mt5(args.write_bases / "mt5")
        return
    if args.exit_hook == "destroy-only":
        destroy_only_at_exit()

    model: Any = MODELS[args.model](args.folder)
    trainer = cpu_trainer(
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        max_epochs=-1,
        precision="bf16-mixed",
    )
    trainer.fit(model, token_data(), ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    if args.report:
        write_report(Path(args.report), trainer.global_rank, {"step": trainer.global_step})


if __name__ == "__main__":
    main()
