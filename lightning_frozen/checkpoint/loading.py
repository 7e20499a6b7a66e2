"""Loading an adapter checkpoint for use without DeepSpeed: into a module that holds its frozen base, or into a
module built from the checkpoint's hyper-parameters, checking keys and shapes and verifying the base first."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import lightning.pytorch as L
import torch
from torch import nn

from lightning_frozen import anatomy
from lightning_frozen.base import qlora
from lightning_frozen.base.fingerprint import FingerprintCache, verify_checkpoint_base
from lightning_frozen.capabilities import PEFT_LAYERS, require
from lightning_frozen.checkpoint.adapter_entries import adapter_state, use_adapter
from lightning_frozen.checkpoint.file import PathLike, checked_location, read_checkpoint
from lightning_frozen.errors import (
    BaseFolderError,
    CheckpointKeysError,
    InvalidArgumentTypeError,
    InvalidArgumentValueError,
    format_names,
)
from lightning_frozen.format import layout
from lightning_frozen.hf import transformers_loading
from lightning_frozen.zero.frozen_compute import KERNELS
from lightning_frozen.zero.params import persistent_buffers

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def check_keys(
    state_dict: Mapping[str, Any], trainable: Mapping[str, Any], buffers: Mapping[str, Any], source: str
) -> None:
    """Raise :class:`CheckpointKeysError` naming trainable params the checkpoint lacks and keys the module lacks."""
    known = set(trainable) | set(buffers)
    missing = sorted(set(trainable) - set(state_dict))
    unexpected = sorted(set(state_dict) - known)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing trainable parameters {format_names(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {format_names(unexpected)} (not trainable parameters or buffers of the module)")
    raise CheckpointKeysError(
        f"{source} does not match the module: {'; '.join(parts)}. Check that the module is built and frozen the same"
        " way as when the checkpoint was saved (same adapter config and trainable parameters), or pass"
        " `strict=False` to load the keys that do match."
    )


def load_into(
    module: nn.Module,
    checkpoint: Mapping[str, Any],
    source: str,
    strict: bool,
    verify: bool,
    adapter: Optional[str] = None,
) -> None:
    """Verify the frozen base of ``module`` and copy the checkpoint's trainable state into it (no DeepSpeed); with
    ``adapter``, only that adapter's, which becomes the module's active adapter."""
    found = anatomy.anatomy_of(module)  # one walk: the adapter's params, the trained copies, its PEFT model
    if found.peft is not None or found.adapter_params:  # the one capability loading reads: each adapter's params
        require(PEFT_LAYERS)
    state_dict = layout.state_dict_of(checkpoint)
    owned = None
    if adapter is not None:
        state_dict, owned = adapter_state(found, checkpoint, adapter, source, type(module).__name__)
    if verify:
        verify_checkpoint_base(checkpoint, module, source, FingerprintCache(kernels=KERNELS), found.trained_copies)
    params = dict(module.named_parameters())
    buffers = persistent_buffers(module)
    frozen_names = set(layout.fingerprint_tensors(layout.fingerprint_of(checkpoint)))
    trainable = {n: p for n, p in params.items() if n not in frozen_names and (p.requires_grad or n in state_dict)}
    if owned is not None:
        trainable = {name: param for name, param in trainable.items() if name in owned}
    if strict:
        check_keys(state_dict, trainable, buffers, source)
    targets = {name: params.get(name, buffers.get(name)) for name in state_dict}
    pairs = [(target, state_dict[name]) for name, target in targets.items() if target is not None]
    for name, target in targets.items():
        # every shape is checked before the first copy, so a refused checkpoint leaves the module as it was
        if target is not None and tuple(target.shape) != tuple(state_dict[name].shape):
            raise CheckpointKeysError(
                f"{source}: `{name}` has shape {tuple(state_dict[name].shape)} in the checkpoint but"
                f" {tuple(target.shape)} in the module. Build the module with the same configuration as when it"
                " was trained."
            )
    with torch.no_grad():
        for target, value in pairs:
            target.copy_(value.to(device=target.device, dtype=target.dtype))
    if adapter is not None:
        use_adapter(found, adapter)


def load_adapter(
    module: ModuleT,
    checkpoint_path: PathLike,
    strict: bool = True,
    verify_base: bool = True,
    adapter: Optional[str] = None,
) -> ModuleT:
    """Load a lightning-frozen checkpoint's trainable state into ``module``, which already holds its frozen base.

    Needs no DeepSpeed and no process group. The frozen base is verified against the checkpoint's fingerprint
    first. With ``adapter`` (one of several adapters trained at once, or the one adapter of a run), only that
    adapter's weights are loaded, into the module's adapter of the same name, which becomes its active adapter.
    Returns ``module``.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module`` or ``checkpoint_path`` is not a path.
        FileNotFoundError, CheckpointFormatError: the file is missing or not a lightning-frozen checkpoint.
        FrozenBaseMismatchError: ``module``'s frozen parameters are not the base the checkpoint was trained on.
        CheckpointKeysError: trainable parameters missing from the checkpoint, or keys the module lacks; the module
            is left unchanged.
        ValueError, AdapterSetupError: ``adapter`` is not in the checkpoint (or None where it holds several and
            ``strict``), or not in ``module``.
        DependencyDriftError: ``module`` holds PEFT's tuner layers and a name of PEFT's that finds each adapter's
            params moved.
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgumentTypeError(
            f"`load_adapter`: `module` must be a torch.nn.Module, got {type(module).__name__}."
        )
    checkpoint = read_checkpoint(checked_location(checkpoint_path, "checkpoint_path", "load_adapter"))
    load_into(module, checkpoint, str(checkpoint_path), strict, verify_base, adapter)
    return module


def load_from_checkpoint(cls: type[ModuleT], checkpoint_path: PathLike, **kwargs: Any) -> ModuleT:
    """Like ``LightningModule.load_from_checkpoint`` for adapter checkpoints.

    Builds ``cls(**hyper_parameters, **kwargs)`` and calls its ``configure_model`` as Lightning does (the module may
    build its frozen base in either; a bitsandbytes ``quantization_config`` given to ``from_pretrained`` there is
    taken off, so the base loads unquantized, the weights its fingerprint is of), verifies the base, loads the
    trainable state, calls ``on_load_checkpoint`` and returns the module in eval mode.
    Keyword arguments ``strict``, ``verify_base`` and ``adapter`` (as :func:`load_adapter`) are taken by this
    function, the rest go to ``cls``.

    Raises:
        TypeError: ``cls`` is not a ``torch.nn.Module`` class (an instance, say) or ``checkpoint_path`` is not a path.
        FileNotFoundError, CheckpointFormatError, FrozenBaseMismatchError, CheckpointKeysError,
            DependencyDriftError: as :func:`load_adapter`.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise InvalidArgumentTypeError(
            f"`load_from_checkpoint`: `cls` must be the module class (e.g. `MyModule`), got"
            f" {f'an instance of `{type(cls).__name__}`' if not isinstance(cls, type) else repr(cls)}. To load into a"
            " module you already built, use `lightning_frozen.load_adapter(module, checkpoint_path)`."
        )
    strict = bool(kwargs.pop("strict", True))
    verify = bool(kwargs.pop("verify_base", True))
    adapter = kwargs.pop("adapter", None)
    checkpoint = read_checkpoint(checked_location(checkpoint_path, "checkpoint_path", "load_from_checkpoint"))
    # LightningCLI and Lightning add private entries (`_class_path`, `_instantiator`) that are no init arguments
    hyper_parameters = {k: v for k, v in layout.hyper_parameters_of(checkpoint).items() if not k.startswith("_")}
    try:
        # a QLoRA module's base: the unquantized weights it was fingerprinted on
        with _base_moved_named(cls, checkpoint, hyper_parameters, kwargs), qlora.loaded_unquantized():
            module = cls(**{**hyper_parameters, **kwargs})
    except TypeError as error:
        raise InvalidArgumentTypeError(
            f"`load_from_checkpoint`: `{cls.__name__}` cannot be built from the hyper-parameters saved in"
            f" {checkpoint_path} ({error}). Was it saved from another class? Pass the class it was trained with, or"
            " override the offending arguments as keyword arguments."
        ) from error
    if callable(getattr(module, "configure_model", None)):
        with (
            _base_moved_named(cls, checkpoint, hyper_parameters, kwargs),
            transformers_loading.base_files_named(),  # a broken shard is named
            qlora.loaded_unquantized(),
        ):
            module.configure_model()  # as Lightning's `load_from_checkpoint` does: the base may be built there
    load_into(module, checkpoint, str(checkpoint_path), strict, verify, adapter)
    if hasattr(module, "on_load_checkpoint"):
        module.on_load_checkpoint(checkpoint)
    return module.eval()


@contextmanager
def _base_moved_named(
    cls: type, checkpoint: Mapping[str, Any], hyper_parameters: Mapping[str, Any], kwargs: Mapping[str, Any]
) -> Iterator[None]:
    """Where the module's own ``from_pretrained`` fails (transformers' ``Repo id must be in the form ...``, or its
    ``OSError``) on a recorded base folder that no longer exists, :class:`BaseFolderError` naming it and the argument
    that moves it, the original chained."""
    try:
        yield
    except (OSError, ValueError) as error:
        reference = layout.reference_of(checkpoint)
        if not reference or Path(reference).exists() or not any(sep in reference for sep in ("/", "\\")):
            raise
        argument = next((k for k, v in hyper_parameters.items() if v == reference), None)
        if argument in kwargs:  # the caller gave the base another folder already: not a moved base
            raise
        fix = f"{argument}='path/to/base'" if argument else "ARGUMENT='path/to/base'"
        raise BaseFolderError(
            f"`load_from_checkpoint`: the checkpoint was trained on the frozen base {reference!r}, which is no folder"
            f" now (moved or deleted?), and `{cls.__name__}` failed to load it ({type(error).__name__}: {error})."
            f" Pass the folder it moved to: `{cls.__name__}.load_from_checkpoint(path, {fix})`"
            + ("" if argument else f", ARGUMENT being the argument of `{cls.__name__}` that names the base")
            + "; for `lightning-frozen export-merged`, `--base path/to/base`."
        ) from error


class AdapterCheckpointMixin:
    """Makes Lightning's own ``MyModule.load_from_checkpoint(path)`` read lightning-frozen checkpoints.

    Put it before ``LightningModule`` in the module's bases (``class MyModule(AdapterCheckpointMixin,
    L.LightningModule)``). Without it, Lightning loads the file's trainable-only ``state_dict`` strictly and torch
    raises ``Missing key(s) in state_dict`` for every frozen weight; with it, the call is
    :func:`load_from_checkpoint`'s (the base built and verified, the trainable state loaded, eval mode). A class
    that lists it after ``LightningModule`` would get Lightning's classmethod instead, and is refused when defined.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        owner = next(klass for klass in cls.__mro__ if "load_from_checkpoint" in vars(klass))
        if owner is L.LightningModule:
            raise InvalidArgumentTypeError(
                f"`{cls.__name__}` lists `AdapterCheckpointMixin` after `LightningModule`, so Lightning's own"
                " `load_from_checkpoint` would answer: put the mixin first,"
                f" `class {cls.__name__}(AdapterCheckpointMixin, L.LightningModule)`."
            )

    @classmethod
    def load_from_checkpoint(
        cls: type[ModuleT],
        checkpoint_path: PathLike,
        map_location: Optional[Union[str, torch.device]] = None,
        hparams_file: Optional[PathLike] = None,
        strict: Optional[bool] = None,
        weights_only: Optional[bool] = None,
        **kwargs: Any,
    ) -> ModuleT:
        """Lightning's signature, answered by :func:`lightning_frozen.load_from_checkpoint`.

        ``map_location`` (a device) moves the loaded module there; ``strict`` is passed on; ``weights_only`` is
        accepted and has no effect, since the file is always read with ``weights_only=True``. Other keyword arguments
        override the saved hyper-parameters, as in Lightning.

        Raises:
            InvalidArgumentValueError: ``hparams_file`` given (pass the hyper-parameters as keyword arguments).
            InvalidArgumentTypeError: ``map_location`` is not a device (a dict or a function, as ``torch.load`` takes).
            FileNotFoundError, CheckpointFormatError, FrozenBaseMismatchError, CheckpointKeysError: as
                :func:`load_from_checkpoint`.
        """
        if hparams_file is not None:
            raise InvalidArgumentValueError(
                f"`{cls.__name__}.load_from_checkpoint`: `hparams_file` is not read for lightning-frozen checkpoints;"
                " pass the hyper-parameters to override as keyword arguments instead."
            )
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise InvalidArgumentTypeError(
                f"`{cls.__name__}.load_from_checkpoint`: `map_location` must be a device such as 'cpu' or 'cuda:0'"
                f" for lightning-frozen checkpoints, got {type(map_location).__name__}."
            )
        if strict is not None:
            kwargs["strict"] = strict
        module = load_from_checkpoint(cls, checkpoint_path, **kwargs)
        return module if map_location is None else module.to(map_location)
