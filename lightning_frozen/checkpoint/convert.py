"""Migration: a checkpoint directory written by Lightning's stock ``DeepSpeedStrategy`` (ZeRO-3) to one adapter file.

DeepSpeed's own ``zero_to_fp32`` reassembles the per-rank shards: its public function the fp32 master weights, the
frozen params and the buffers; its private merge, fed the same way, each optimizer state (Adam's moments), so the
converted file resumes training like one of ours. The file is built by ``layout.assemble``, as a save builds it.
DeepSpeed's files are pickles and its helpers load them with ``weights_only=False``: every load here, theirs
included, runs with ``weights_only=True`` allowing only the few DeepSpeed classes such a file holds, so a file
carrying anything else is refused before any of it runs.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_frozen.anatomy import anatomy_of
from lightning_frozen.base.fingerprint import fingerprint_base
from lightning_frozen.capabilities import CONVERT, PEFT_LAYERS, require
from lightning_frozen.checkpoint import trainable_state
from lightning_frozen.checkpoint.file import (
    PathLike,
    checked_path,
    deepspeed_shard_folder,
    load_error,
    to_plain,
    unsafe_globals,
    write_atomic,
)
from lightning_frozen.errors import CheckpointFormatError, CheckpointNotFoundError
from lightning_frozen.format import layout
from lightning_frozen.hf import peft_adapters
from lightning_frozen.zero import checkpoint_files
from lightning_frozen.zero.frozen_compute import KERNELS
from lightning_frozen.zero.params import scaler_state

log = logging.getLogger(__name__)


@contextmanager
def _weights_only_loads(source: Path, files: list[str]) -> Iterator[None]:
    """Allow the DeepSpeed classes its checkpoint files hold in the ``weights_only`` loads inside; a file with anything
    else raises :class:`CheckpointFormatError`."""
    with torch.serialization.safe_globals(checkpoint_files.pickled_classes()):
        try:
            yield
        except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, ValueError, OSError) as error:
            for path in files:
                unexpected = unsafe_globals(Path(path))
                if unexpected:
                    raise CheckpointFormatError(
                        f"{path} holds Python objects a DeepSpeed checkpoint does not ({', '.join(unexpected[:5])});"
                        " nothing in it was executed. Convert only checkpoints you trust; if you do trust it, allow"
                        " those classes with `torch.serialization.add_safe_globals([...])` first."
                    ) from None
            raise CheckpointFormatError(
                f"{source} has a shard file that cannot be read (truncated or corrupt? {load_error(error)})."
            ) from None


def module_from_directory(source: PathLike, module_class: type[nn.Module]) -> nn.Module:
    """``module_class`` built as for training from the hyper-parameters the stock directory saved (``__init__``, then
    ``configure_model``): the ``module`` :func:`convert_deepspeed_checkpoint` takes, for the command line.

    Raises:
        FileNotFoundError, CheckpointFormatError: as :func:`convert_deepspeed_checkpoint`.
    """
    source = checked_path(source, "source", "convert_deepspeed_checkpoint")
    model_files, optim_files = checkpoint_files.shard_files(_checkpoint_folder(source))
    with _weights_only_loads(source, [*model_files, *optim_files]):
        client = torch.load(model_files[0], map_location="cpu", weights_only=True)
    # LightningCLI and Lightning add private entries (`_class_path`, `_instantiator`) that are no init arguments
    hyper_parameters = {k: v for k, v in layout.hyper_parameters_of(client).items() if not k.startswith("_")}
    module = module_class(**hyper_parameters)
    if callable(getattr(module, "configure_model", None)):
        module.configure_model()
    return module


def _checkpoint_folder(source: Path) -> Path:
    if not source.exists():
        raise CheckpointNotFoundError(f"No DeepSpeed checkpoint at {source}.")
    if not source.is_dir():
        raise CheckpointFormatError(
            f"{source} is a file; a stock DeepSpeed checkpoint is a directory (with `latest` and a `checkpoint/`"
            " folder). A lightning-frozen file needs no conversion."
        )
    folder = deepspeed_shard_folder(source)
    if folder is None:
        raise CheckpointFormatError(
            f"{source} does not look like a DeepSpeed checkpoint: no `*_model_states.pt` files in the folder its"
            " `latest` file names, or in `checkpoint/`."
        )
    return folder


def convert_deepspeed_checkpoint(
    source: PathLike, destination: PathLike, reference: Optional[str] = None, module: Optional[nn.Module] = None
) -> Path:
    """Convert a stock Lightning DeepSpeed ZeRO-3 checkpoint directory to a lightning-frozen file.

    The file has the entries a save of the same run under ``frozen_deepspeed`` writes: the trainable params (fp32
    masters) and buffers, the optimizer state by name with DeepSpeed's loss-scaler state, every entry of Lightning's
    (loops, callbacks, schedulers, hyper-parameters, what ``on_save_checkpoint`` added), and the frozen base's
    fingerprint when the directory holds the frozen weights (DeepSpeed's default; with
    ``exclude_frozen_parameters=True`` it cannot, and the base goes unverified). ``reference`` names the frozen base.

    What the directory does not record comes from ``module``, the LightningModule it was trained from, built as for
    training (its model and adapters in place; its weights need not be the trained ones): the base's reference
    (unless ``reference`` is given), each base's reference where there are several, and for a PEFT model the export
    entries (the adapter config and the PEFT key of each tensor) that ``export_peft_adapter`` needs; the originals of
    PEFT's ``modules_to_save`` are then left out of the fingerprint, as a save leaves them. Without it the file has
    none of these. The format marker records ``converted_from`` instead of ``precision``: the directory holds
    DeepSpeed's fp16/bf16 switch, which ``16-mixed`` and ``16-true`` (or ``bf16-mixed`` and ``bf16-true``) set alike.
    Returns ``destination``.

    Raises:
        TypeError: ``source`` or ``destination`` is not a path.
        FileNotFoundError: ``source`` does not exist.
        CheckpointFormatError: ``source`` is not a ZeRO-3 DeepSpeed checkpoint, has a damaged shard file or holds
            unexpected Python objects (refused unexecuted), or ``destination`` is a directory. Nothing is written
            then, and an existing file at ``destination`` stays as it was.
        DependencyDriftError: a private name of DeepSpeed's that reading its directory needs moved, or of PEFT's
            that names the adapters' params of a `module` with tuner layers.
    """
    require(CONVERT)
    source = checked_path(source, "source", "convert_deepspeed_checkpoint")
    destination = checked_path(destination, "destination", "convert_deepspeed_checkpoint")
    folder = _checkpoint_folder(source)
    model_files, optim_files = checkpoint_files.shard_files(folder)
    log.warning(
        "lightning-frozen: reading %d model and %d optimizer shard files from %s",
        len(model_files),
        len(optim_files),
        folder,
    )
    with _weights_only_loads(source, [*model_files, *optim_files]):
        model_states = checkpoint_files.read_model_states(model_files)
        optim_states = [
            torch.load(path, map_location="cpu", weights_only=True)["optimizer_state_dict"] for path in optim_files
        ]
        client = torch.load(model_files[0], map_location="cpu", weights_only=True)
    if optim_states[0].get("zero_stage") != 3:
        raise CheckpointFormatError(
            f"{source} was written with ZeRO stage {int(optim_states[0].get('zero_stage'))}; only stage 3 converts."
        )
    world_size = len(optim_states)

    log.warning("lightning-frozen: reassembling %d ranks' trainable shards", world_size)
    with _weights_only_loads(source, [*model_files, *optim_files]):
        whole = checkpoint_files.read_fp32_tensors(folder)
    group_names = [list(shapes) for shapes in model_states[0].param_shapes]
    # the trainable params (fp32 masters) alone, cloned off the merge's padded buffer; DeepSpeed's shared-param aliases
    # and the frozen params stay out
    state_dict = {name: whole[name].clone() for names in group_names for name in names}
    inner = [o["optimizer_state_dict"] for o in optim_states]
    per_element = [
        key for key, value in inner[0]["state"].get(0, {}).items() if torch.is_tensor(value) and value.dim() > 0
    ]
    per_name: dict[str, dict[str, Any]] = {name: {} for name in state_dict}
    for key in per_element:
        flats = [[rank["state"][group][key] for group in sorted(rank["state"])] for rank in inner]
        for name, tensor in checkpoint_files.merge_trainable(world_size, flats, model_states).items():
            per_name[name][key] = tensor
    for group_index, names in enumerate(group_names):
        scalars = {k: v for k, v in inner[0]["state"].get(group_index, {}).items() if k not in per_element}
        for name in names:
            per_name[name].update(scalars)
    param_groups = [
        layout.param_group_entry(group, names) for group, names in zip(inner[0]["param_groups"], group_names)
    ]
    optimizer_entry = layout.optimizer_entry(
        per_name, param_groups, scaler_state(checkpoint_files.loss_scaler_of(optim_states[0]))
    )

    state_dict.update({name: value for name, value in model_states[0].buffers.items()})
    frozen = {name: whole[name] for name in model_states[0].frozen_param_shapes or {}}
    if module is not None and peft_adapters.holds_tuner_layers(module):  # its adapters' params, named by PEFT's layers
        require(PEFT_LAYERS)
    found = anatomy_of(module, reference) if module is not None else None
    for name in found.trained_copies if found is not None else ():
        frozen.pop(name, None)  # as a save does: the adapted model computes with their trained copies instead
    if frozen:
        fingerprint = fingerprint_base(sorted(frozen.items()), kernels=KERNELS)
    else:
        log.warning("lightning-frozen: %s holds no frozen weights; the converted file cannot verify its base", source)
        fingerprint = layout.fingerprint_entry("none", None, {})
    if module is None or found is None:
        frozen_base = layout.new_frozen_base_entry(reference, fingerprint)
    else:
        frozen_base = trainable_state.frozen_base_entry(module, found, fingerprint, list(per_name))
    lightning_entries = {key: value for key, value in client.items() if key not in checkpoint_files.ENGINE_STATE_KEYS}
    marker = layout.format_marker(**{layout.WORLD_SIZE: world_size, layout.CONVERTED_FROM: str(source)})
    converted = layout.assemble(lightning_entries, state_dict, [optimizer_entry], frozen_base, marker)
    write_atomic(to_plain(converted), destination)
    log.warning("lightning-frozen: wrote %s (%d trainable tensors)", destination, len(per_name))
    return destination
