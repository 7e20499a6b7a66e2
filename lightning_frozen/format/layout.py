"""The checkpoint's layout: every key of the file as a named constant, the one builder that assembles it, and the
accessors that read it back. No other module spells a key of the checkpoint.

One file, whatever the number of ranks that wrote it, that ``torch.load(path, weights_only=True)`` opens:

- Lightning's own entries (``epoch``, ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``,
  ``hyper_parameters``, ... and what ``on_save_checkpoint`` hooks add), as Lightning's ``dump_checkpoint`` made them;
- ``state_dict``: the trainable parameters (fp32 master values) and persistent buffers, never a frozen weight;
- ``optimizer_states``: ``[{"layout": "by_name", "state": {param name: {key: whole tensor or scalar}},
  "param_groups": [{hyper-parameters..., "params": [param names]}], "loss_scaler": {...}}]``, keyed by parameter
  name so that any world size can resume; the fp32 weights are not stored twice (absent in a weights-only save);
- ``frozen_base``: ``reference`` (where the base came from, or None), ``fingerprint`` (``{"mode", "digest",
  "tensors": {name: {"shape", "dtype", "value", "value_fp16"?}}}``), and where they apply ``bases`` (each base's
  reference by module path, with several), ``peft`` (one adapter's PEFT export entry, see ``peft_export.py``) or
  ``peft_adapters`` (adapter name -> entry, several trained at once), ``quantization`` (how the frozen shards were
  stored, ``codec.BlockFormat.describe``);
- ``lightning_frozen``: ``{"format_version": 1, ...how it was written}``: ``world_size`` and ``precision`` for a
  save, ``world_size`` and ``converted_from`` for ``convert``.

Files written by 0.1.0 have this layout without ``loss_scaler``, ``bases``, ``peft_adapters`` and a PEFT entry's
``adapter_name``; every reader here treats those as absent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_frozen.errors import CheckpointFormatError

# ------------------------------------------------------------------------------------------- top level
STATE_DICT = "state_dict"
OPTIMIZER_STATES = "optimizer_states"
HYPER_PARAMETERS = "hyper_parameters"
FROZEN_BASE = "frozen_base"
FORMAT_KEY = "lightning_frozen"

# ------------------------------------------------------------------------------------------- format marker
FORMAT_VERSION_KEY = "format_version"
FORMAT_VERSION = 1
WORLD_SIZE = "world_size"
PRECISION = "precision"
CONVERTED_FROM = "converted_from"

# ------------------------------------------------------------------------------------------- optimizer entry
OPTIMIZER_LAYOUT_KEY = "layout"
OPTIMIZER_LAYOUT = "by_name"
OPTIMIZER_STATE = "state"
PARAM_GROUPS = "param_groups"
GROUP_PARAMS = "params"
LOSS_SCALER = "loss_scaler"

# ------------------------------------------------------------------------------------------- frozen-base entry
REFERENCE = "reference"
FINGERPRINT = "fingerprint"
BASES = "bases"
PEFT = "peft"
PEFT_ADAPTERS = "peft_adapters"
QUANTIZATION = "quantization"

# the fingerprint, and each tensor's record in it
FINGERPRINT_MODE = "mode"
DIGEST = "digest"
TENSORS = "tensors"
SHAPE = "shape"
DTYPE = "dtype"
VALUE = "value"  # the checksum of the values cast to bf16, or (sha256 mode) the hash of the bytes
VALUE_FP16 = "value_fp16"  # the checksum of the values cast to fp16

# the quantization entry (``DTYPE`` names the stored format there)
BLOCK_SIZE = "block_size"
SCALE_DTYPE = "scale_dtype"
BYTES_PER_WEIGHT = "bytes_per_weight"
CODE_VALUES = "code_values"
SCALE = "scale"
PACKING = "packing"  # NF4: which nibble of a byte holds the first of its two weights; absent before 0.2 (the low)

# a PEFT export entry
PEFT_PREFIX = "prefix"
ADAPTER_NAME = "adapter_name"
PEFT_CONFIG = "config"
PEFT_KEYS = "keys"
PROMPT_ENCODER = "prompt_encoder"
NOT_IN_ADAPTER = "not_in_adapter"
NOT_EXPORTABLE = "not_exportable"
ADAPTED_CLASS = "adapted_class"  # the adapted model's class, ``module.QualName``; absent in older files


# ---------------------------------------------------------------------------------------------- building


def assemble(
    lightning_entries: Mapping[str, Any],
    state_dict: Mapping[str, Any],
    optimizer_states: Optional[Sequence[Mapping[str, Any]]],
    frozen_base: dict[str, Any],
    marker: dict[str, Any],
) -> dict[str, Any]:
    """The checkpoint dict, the one way a save and ``convert`` build it: Lightning's own entries (any of ours among
    them replaced), the trainable ``state_dict``, the :func:`optimizer_entry` list (None for a weights-only save),
    the :func:`new_frozen_base_entry` and the :func:`format_marker`."""
    checkpoint = {key: value for key, value in lightning_entries.items() if key not in (FROZEN_BASE, FORMAT_KEY)}
    checkpoint[STATE_DICT] = dict(state_dict)
    if optimizer_states is not None:
        checkpoint[OPTIMIZER_STATES] = [dict(entry) for entry in optimizer_states]
    checkpoint[FROZEN_BASE] = frozen_base
    checkpoint[FORMAT_KEY] = marker
    return checkpoint


def format_marker(**details: Any) -> dict[str, Any]:
    """The ``lightning_frozen`` entry that marks a checkpoint as this package's: the format version and ``details``
    of how it was written (``world_size``, ``precision``, ``converted_from``)."""
    return {FORMAT_VERSION_KEY: FORMAT_VERSION, **details}


def optimizer_entry(
    state: Mapping[str, Any], param_groups: list[dict[str, Any]], loss_scaler: Mapping[str, Any]
) -> dict[str, Any]:
    """One ``optimizer_states`` entry: per-param ``state`` by name, :func:`param_group_entry` groups and the loss
    scaler's state (see ``zero.params.loss_scaler_state``)."""
    return {
        OPTIMIZER_LAYOUT_KEY: OPTIMIZER_LAYOUT,
        OPTIMIZER_STATE: dict(state),
        PARAM_GROUPS: param_groups,
        LOSS_SCALER: dict(loss_scaler),
    }


def param_group_entry(group: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A saved param group: the hyper-parameters of ``group`` (a torch ``param_groups`` entry) and its params' names."""
    return {**group_hyper_parameters(group), GROUP_PARAMS: list(names)}


def group_hyper_parameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A saved (or live) param group's hyper-parameters, without its params."""
    return {key: value for key, value in group.items() if key != GROUP_PARAMS}


def new_frozen_base_entry(
    reference: Optional[str],
    fingerprint: dict[str, Any],
    bases: Optional[Mapping[str, str]] = None,
    peft: Optional[dict[str, Any]] = None,
    peft_adapters: Optional[Mapping[str, dict[str, Any]]] = None,
    quantization: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The ``frozen_base`` entry; ``bases`` is recorded with more than one base, the optional entries when given."""
    entry: dict[str, Any] = {REFERENCE: reference, FINGERPRINT: fingerprint}
    if bases is not None and len(bases) > 1:
        entry[BASES] = dict(bases)
    if peft is not None:
        entry[PEFT] = peft
    if peft_adapters is not None:
        entry[PEFT_ADAPTERS] = dict(peft_adapters)
    if quantization is not None:
        entry[QUANTIZATION] = quantization
    return entry


def fingerprint_entry(mode: str, digest: Optional[str], tensors: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``fingerprint`` of the frozen base (``fingerprint.fingerprint_base`` fills it)."""
    return {FINGERPRINT_MODE: mode, DIGEST: digest, TENSORS: dict(tensors)}


def tensor_record(shape: Sequence[int], dtype: str) -> dict[str, Any]:
    """One tensor's record in the fingerprint, before its ``VALUE`` (and ``VALUE_FP16``) checksums are added."""
    return {SHAPE: [int(size) for size in shape], DTYPE: dtype}


# ---------------------------------------------------------------------------------------------- reading


def validate(checkpoint: Any, path: Any) -> None:
    """Raise :class:`CheckpointFormatError` unless ``checkpoint`` has this package's layout, naming ``path``."""
    if not isinstance(checkpoint, dict):
        raise CheckpointFormatError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    marker = checkpoint.get(FORMAT_KEY)
    if not isinstance(marker, dict):
        hint = (
            " It looks like a plain Lightning checkpoint (full weights): load it with"
            " `YourModule.load_from_checkpoint`, and to train on from those weights, fit that module without"
            " `ckpt_path`."
            if STATE_DICT in checkpoint
            else ""
        )
        raise CheckpointFormatError(f"{path} is not a lightning-frozen checkpoint (no `{FORMAT_KEY}` key).{hint}")
    version = marker.get(FORMAT_VERSION_KEY)
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{path} has lightning-frozen format version {version}; this version reads {FORMAT_VERSION}."
            " Upgrade lightning-frozen to read it."
        )
    for key in (STATE_DICT, FROZEN_BASE):
        if not isinstance(checkpoint.get(key), dict):
            raise CheckpointFormatError(f"{path} is missing its `{key}` entry; the file is damaged.")


def state_dict_of(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The trainable tensors (and buffers) by name."""
    return checkpoint[STATE_DICT]


def frozen_base_of(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``frozen_base`` entry."""
    return checkpoint[FROZEN_BASE]


def reference_of(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """The frozen base's recorded reference, or None."""
    return frozen_base_of(checkpoint).get(REFERENCE)


def bases_of(checkpoint: Mapping[str, Any]) -> Optional[Mapping[str, str]]:
    """Each base's reference by module path, where the module held several; else None."""
    return frozen_base_of(checkpoint).get(BASES)


def fingerprint_of(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The recorded fingerprint (empty when none was recorded)."""
    return frozen_base_of(checkpoint).get(FINGERPRINT) or {}


def fingerprint_tensors(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """A fingerprint's per-tensor records by name."""
    return fingerprint.get(TENSORS, {})


def quantization_of(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The record of how the base was stored when trained (empty when it was not quantized)."""
    return dict(frozen_base_of(checkpoint).get(QUANTIZATION) or {})


def quantized_dtype_of(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """The ``frozen_dtype`` the base was stored in when trained (``"int8"``, ``"nf4"``...), None if not quantized."""
    return quantization_of(checkpoint).get(DTYPE)


def hyper_parameters_of(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The module's saved ``hyper_parameters`` (empty when none were saved)."""
    return dict(checkpoint.get(HYPER_PARAMETERS) or {})


def saved_param_groups(checkpoint: Mapping[str, Any]) -> Optional[list[dict[str, Any]]]:
    """The saved optimizer's param groups (hyper-parameters and param names), None when the file has none."""
    entries = checkpoint.get(OPTIMIZER_STATES) or []
    return entries[0].get(PARAM_GROUPS) if entries else None


def check_optimizer_entry(entry: Mapping[str, Any]) -> None:
    """Refuse an ``optimizer_states`` entry that is not keyed by parameter name (a stock Lightning or DeepSpeed one).

    Raises:
        CheckpointFormatError: naming ``lightning-frozen convert`` as the fix.
    """
    if entry.get(OPTIMIZER_LAYOUT_KEY) != OPTIMIZER_LAYOUT:
        raise CheckpointFormatError(
            "The checkpoint's optimizer state is not keyed by parameter name; it was not written by"
            " lightning-frozen. Convert it with `lightning-frozen convert`."
        )


def peft_entries_of(frozen_base: Mapping[str, Any]) -> tuple[Mapping[str, Any], Optional[Mapping[str, Any]]]:
    """The PEFT export entries of a ``frozen_base`` entry: those of adapters trained at once by name (empty if none),
    and the one adapter's entry (None if none)."""
    return frozen_base.get(PEFT_ADAPTERS) or {}, frozen_base.get(PEFT)


def adapter_tensor_names(entry: Mapping[str, Any]) -> list[str]:
    """The ``state_dict`` names a PEFT export entry exports: those mapped to PEFT keys, then the prompt encoder's."""
    return [*entry[PEFT_KEYS], *entry.get(PROMPT_ENCODER, {}).values()]
