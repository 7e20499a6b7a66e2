"""Exceptions a caller can catch; each message names the thing at fault and the fix."""

from __future__ import annotations

from collections.abc import Sequence


def format_names(names: Sequence[str], limit: int = 5) -> str:
    """Names for a message: the first ``limit`` in backticks, then how many more there are."""
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class FrozenTrainingError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class NoTrainableParametersError(FrozenTrainingError):
    """The model has nothing to train: every parameter is frozen."""


class ForeignParametersError(FrozenTrainingError):
    """The optimizer holds parameters that are not part of the LightningModule."""


class FrozenSetChangedError(FrozenTrainingError):
    """A parameter's ``requires_grad`` flipped during training without a finetuning callback."""


class UnsupportedOffloadOptimizerError(FrozenTrainingError):
    """Optimizer offload was asked for with an optimizer DeepSpeed cannot run on the CPU."""


class FrozenBaseMismatchError(FrozenTrainingError):
    """A checkpoint meets a frozen base other than the one it was trained on."""


class CheckpointFormatError(FrozenTrainingError):
    """A file is not a readable lightning-frozen checkpoint (truncated, foreign or of another layout)."""


class CheckpointKeysError(FrozenTrainingError):
    """A checkpoint's trainable state does not match the module's trainable parameters."""


class DependencyDriftError(FrozenTrainingError):
    """An installed Lightning, DeepSpeed, transformers, PEFT or torch moved a private name the package needs (gone, or
    another signature): raised when the strategy is built, naming each name, its package's version and the releases
    the package was written for."""


# Errors that are also a built-in type, so callers that caught the built-in before keep catching them.


class InvalidArgumentTypeError(FrozenTrainingError, TypeError):
    """An argument of a public function or of the strategy has the wrong type."""


class InvalidArgumentValueError(FrozenTrainingError, ValueError):
    """An argument of a public function or of the strategy has a value that cannot work."""


class FrozenBaseFileError(FrozenTrainingError, OSError):
    """A weights file of the frozen base (a safetensors shard) cannot be read: it is truncated or corrupt."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"The frozen base's weights file {path} cannot be read ({reason}): it is truncated or corrupt, as an"
            " interrupted download or copy leaves it. Download or copy that file again (a hub model: pass"
            " `force_download=True` to `from_pretrained` once, or delete the file from the cache) and rerun."
        )
        self.path, self.reason = path, reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickled across processes with its own arguments
        return type(self), (self.path, self.reason)


class CheckpointNotFoundError(CheckpointFormatError, FileNotFoundError):
    """No checkpoint file at the path given: nothing there, a folder that holds none, or a path inside a stock
    DeepSpeed checkpoint. A ``FileNotFoundError`` as stock ``DeepSpeedStrategy.load_checkpoint`` raises, and a
    ``CheckpointFormatError`` as the package raised for a folder before."""


class BaseFolderError(FrozenTrainingError, FileNotFoundError):
    """The base folder a merged export reads is not there, holds no safetensors weights, or lacks a tensor."""


class OutputDirectoryError(FrozenTrainingError, NotADirectoryError):
    """The output folder given is an existing file."""


class UnsupportedConfigurationError(FrozenTrainingError, NotImplementedError):
    """A setup this package cannot run (an accelerator, a callback, a training mode, a storage location)."""


class SchedulerGroupsError(FrozenTrainingError, ValueError):
    """No longer raised: param groups are kept as built, so every LR scheduler follows them. Kept for code that
    catches it."""


class FrozenDtypeError(FrozenTrainingError, ValueError):
    """A ``frozen_dtype`` (quantized frozen storage) that is unknown, or cannot be used for this param or device."""


class AdapterSetupError(FrozenTrainingError, ValueError):
    """Several adapters trained at once cannot be set up as asked: an unknown name, a tuner that cannot be mixed in
    one batch, or an optimizer group or a trainable param shared by several adapters."""


class BitsAndBytesConfigError(FrozenTrainingError, ValueError):
    """A bitsandbytes ``quantization_config`` (or a model bitsandbytes quantized) that the strategy cannot store as
    its frozen shards: fp4, a trainable int8 base, modules left unquantized, a pre-quantized folder, a ``frozen_dtype``
    that disagrees, or a base quantized outside ``configure_model``."""


class UnevenBatchesError(FrozenTrainingError):
    """The ranks have different numbers of evaluation batches: under ZeRO-3 every forward gathers shards from every
    rank, so the rank with more batches would wait forever for the others."""

    raised_on_every_rank = True  # the ranks agreed on it: each ends by itself
