"""Export an adapter checkpoint to PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

At save time :func:`peft_entry` records which PEFT adapter key each trainable tensor becomes, found by PEFT itself (a
probe state dict through ``get_peft_model_state_dict`` and each ``modules_to_save`` wrapper), so export needs neither
the model nor its base. Prompt learning saves the prompt encoder's output (``prompt_embeddings``), which nothing can
run under ZeRO-3 at save time: export computes it on the CPU from the encoder's saved tensors with PEFT's own class.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_frozen.checkpoint.atomic_files import check_output_folder, folder_written_whole
from lightning_frozen.checkpoint.file import PathLike, checked_path, read_checkpoint, to_plain
from lightning_frozen.errors import CheckpointFormatError, InvalidArgumentValueError
from lightning_frozen.format import layout
from lightning_frozen.hf import peft_saving

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# what an export writes: a folder holding only these is replaced whole (anything else of the user's is never deleted)
EXPORTED_NAMES = frozenset((CONFIG_NAME, WEIGHTS_NAME))
# the PEFT key prompt learning saves its encoder's output under (`BasePromptEncoder._get_adapter_state_dict`)
PROMPT_EMBEDDINGS = "prompt_embeddings"
# prompt learning methods whose saved tensor export can compute: PEFT's `get_prompt_embedding_to_save` runs their
# encoder on all virtual tokens; multitask prompt tuning, CPT and cartridges save differently
EXPORTABLE_PROMPT_LEARNING = ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING")


def peft_entry(
    prefix: str,
    peft_model: Any,
    trainable_names: Sequence[str],
    buffer_names: Sequence[str] = (),
    adapter_name: Optional[str] = None,
) -> dict[str, Any]:
    """What the checkpoint keeps to export later, in plain types (``weights_only``-loadable).

    ``{"prefix", "adapter_name", "config", "keys": {our name: PEFT key}, "prompt_encoder": {encoder's own name: our
    name}, "not_in_adapter": [our names], "not_exportable": reason or None, "adapted_class": the adapted model's class
    as ``module.QualName``}``. ``trainable_names`` and ``buffer_names`` are the checkpoint's ``state_dict`` names (of
    the LightningModule); ``prefix`` is the PeftModel's name in it. ``adapter_name`` defaults to the active adapter.
    Runs no part of the model: under ZeRO-3 its weights are partitioned here.
    """
    adapter_name = adapter_name or peft_model.active_adapter
    peft_config = peft_model.peft_config[adapter_name]
    adapted_model = peft_model.get_base_model()
    lead = f"{prefix}." if prefix else ""
    ours = [name for name in trainable_names if name.startswith(lead)]
    probe = {name[len(lead) :]: torch.empty(0) for name in [*ours, *(b for b in buffer_names if b.startswith(lead))]}
    ours_by_id = {id(tensor): f"{lead}{name}" for name, tensor in probe.items()}
    peft_type = to_plain(peft_config.peft_type, json_types=True)
    encoder: dict[str, str] = {}
    not_exportable = None
    if peft_config.is_prompt_learning:
        encoder_lead = f"prompt_encoder.{adapter_name}."
        encoder = {name[len(encoder_lead) :]: f"{lead}{name}" for name in probe if name.startswith(encoder_lead)}
        mapped = peft_saving.auxiliary_state_dict(peft_model, adapter_name, probe)
        if peft_type not in EXPORTABLE_PROMPT_LEARNING:
            not_exportable = (
                f"PEFT saves {peft_type} prompts in a form lightning-frozen does not compute; export supports"
                f" {', '.join(EXPORTABLE_PROMPT_LEARNING)}"
            )
    else:
        try:
            mapped = peft_saving.adapter_state_dict(peft_model, probe, adapter_name)
        except Exception as error:  # a tuner whose saving reads values or shared aliases (VB-LoRA): the save goes on
            mapped = {}
            not_exportable = (
                f"PEFT cannot map {peft_type} tensors without their values ({type(error).__name__}: {error})"
            )
    keys = {ours_by_id[id(value)]: key for key, value in mapped.items() if id(value) in ours_by_id}
    computed = sorted(key for key, value in mapped.items() if id(value) not in ours_by_id)
    if computed and not_exportable is None:
        not_exportable = f"PEFT computes the adapter tensors {computed[:5]} at save time instead of copying them"
    if not_exportable:
        rank_zero_warn(
            f"lightning-frozen: this {peft_type} adapter cannot be exported to PEFT's format: {not_exportable}. Its"
            " checkpoints resume and load with `lightning_frozen.load_adapter` as usual."
        )
    in_adapter = set(keys) | set(encoder.values())
    return {
        layout.PEFT_PREFIX: prefix,
        layout.ADAPTER_NAME: adapter_name,
        layout.PEFT_CONFIG: to_plain(peft_config.to_dict(), json_types=True),
        layout.PEFT_KEYS: keys,
        layout.PROMPT_ENCODER: encoder,
        layout.NOT_IN_ADAPTER: sorted(set(trainable_names) - in_adapter),
        layout.NOT_EXPORTABLE: not_exportable,
        layout.ADAPTED_CLASS: f"{type(adapted_model).__module__}.{type(adapted_model).__qualname__}",
    }


def prompt_embeddings(config: Mapping[str, Any], encoder_weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """PEFT's saved ``prompt_embeddings``: the output for all virtual tokens, in fp32, of the prompt encoder of
    ``config`` holding ``encoder_weights`` (by its own names), as PEFT's ``get_prompt_embedding_to_save`` computes it.

    Raises:
        CheckpointFormatError: the weights do not fit the encoder the config describes.
    """
    peft_type = config["peft_type"]
    encoder = peft_saving.prompt_encoder(config).float()
    try:
        encoder.load_state_dict({name: value.float() for name, value in encoder_weights.items()}, strict=True)
    except RuntimeError as error:
        raise CheckpointFormatError(
            f"The checkpoint's prompt encoder tensors {sorted(encoder_weights)} do not fit the {peft_type} encoder its"
            f" adapter config describes ({str(error).splitlines()[0]})."
        ) from None
    tokens = torch.arange(encoder.embedding.num_embeddings).unsqueeze(0)  # every virtual token, in order
    with torch.no_grad():
        return encoder(tokens)[0]


def peft_entry_of(frozen_base: Mapping[str, Any], adapter: Optional[str], source: PathLike) -> dict[str, Any]:
    """The checkpoint's PEFT entry (see :func:`peft_entry`) for ``adapter``: of the adapters trained at once, the one
    named (``peft_adapters``); else the one adapter, which ``adapter`` may name.

    Raises:
        CheckpointFormatError: the file holds no PEFT entry.
        InvalidArgumentValueError: ``adapter`` names no adapter of the file, or is None where it holds several.
    """
    several, single = layout.peft_entries_of(frozen_base)
    if several and adapter in several:
        return several[adapter]
    if not several and single and adapter in (None, single.get(layout.ADAPTER_NAME)):  # older files name none
        return single
    if not several and not single:
        raise CheckpointFormatError(
            f"{source} was not trained on a PEFT model (no `frozen_base['peft']` entry), so it has no PEFT"
            " adapter to export. Load it with `lightning_frozen.load_adapter` instead."
        )
    held = list(several) or [single[layout.ADAPTER_NAME]]
    raise InvalidArgumentValueError(
        f"{source} holds adapter(s) {', '.join(f'`{name}`' for name in held)}"
        f"{'' if adapter is None else f', not `{adapter}`'}. Pass `adapter=` one of them."
    )


def export_peft_adapter(checkpoint_path: PathLike, output_dir: PathLike, adapter: Optional[str] = None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` for ``peft.PeftModel.from_pretrained``.

    Of a run that trained several adapters at once, ``adapter`` names the one to export (alone, as PEFT saves one).

    The folder is written whole: the two files go into a new temporary folder beside ``output_dir``, which then
    takes its place in one rename, so a crash at any moment leaves the previous folder as it was. An existing
    ``output_dir`` is replaced only when it holds nothing but an earlier export (those two files); one holding
    anything else (PEFT's ``README.md``, a planted link) is refused before anything is read or written. Trainable
    parameters that are not part of the PEFT adapter (a head outside the ``PeftModel``) cannot go into it and are
    named in a warning. Returns ``output_dir``.

    Raises:
        TypeError: ``checkpoint_path`` or ``output_dir`` is not a path.
        CheckpointFormatError: the checkpoint was not trained on a PEFT model, is not a lightning-frozen file,
            or holds a prompt learning method whose saved form export does not compute (multitask prompt tuning, CPT).
        NotADirectoryError: ``output_dir`` exists and is a file, or a folder holding other entries
            (:class:`~lightning_frozen.errors.OutputDirectoryError`).
        ValueError: ``adapter`` names no adapter of the checkpoint, or is None where it holds several.
    """
    from safetensors.torch import save

    checkpoint_path = checked_path(checkpoint_path, "checkpoint_path", "export_peft_adapter")
    folder = checked_path(output_dir, "output_dir", "export_peft_adapter")
    check_output_folder(folder, EXPORTED_NAMES.__contains__)
    checkpoint = read_checkpoint(checkpoint_path)
    peft = peft_entry_of(layout.frozen_base_of(checkpoint), adapter, checkpoint_path)
    if peft.get(layout.NOT_EXPORTABLE):
        raise CheckpointFormatError(
            f"{checkpoint_path} cannot be exported to PEFT's format: {peft[layout.NOT_EXPORTABLE]}. Load it with"
            " `lightning_frozen.load_adapter` instead."
        )
    state_dict = layout.state_dict_of(checkpoint)
    missing = sorted(name for name in layout.adapter_tensor_names(peft) if name not in state_dict)
    if missing:
        raise CheckpointFormatError(f"{checkpoint_path} lacks adapter weights {missing[:5]}; the file is damaged.")
    outside = peft.get(layout.NOT_IN_ADAPTER)
    if outside:
        rank_zero_warn(
            f"lightning-frozen: {len(outside)} trainable tensors are outside the PEFT model and not in"
            f" the exported adapter: {outside[:5]}. Put them in the PEFT config's `modules_to_save`"
            " to export them too."
        )
    tensors = {key: state_dict[name].detach().contiguous() for name, key in peft[layout.PEFT_KEYS].items()}
    if peft.get(layout.PROMPT_ENCODER):
        encoder_weights = {own: state_dict[name] for own, name in peft[layout.PROMPT_ENCODER].items()}
        tensors[PROMPT_EMBEDDINGS] = prompt_embeddings(peft[layout.PEFT_CONFIG], encoder_weights).contiguous()
    config = dict(peft[layout.PEFT_CONFIG])
    reference = layout.reference_of(checkpoint)
    if reference and not config.get("base_model_name_or_path"):
        config["base_model_name_or_path"] = reference
    with folder_written_whole(folder, EXPORTED_NAMES.__contains__) as written:
        (written / WEIGHTS_NAME).write_bytes(save(tensors, metadata={"format": "pt"}))
        (written / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder
