"""lightning-frozen: DeepSpeed ZeRO-3 for Lightning models whose larger part is frozen.

Importing the package registers the strategy names (``frozen_deepspeed`` and friends) with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_frozen.checkpoint.convert import convert_deepspeed_checkpoint
from lightning_frozen.checkpoint.file import read_checkpoint
from lightning_frozen.checkpoint.loading import load_adapter, load_from_checkpoint
from lightning_frozen.checkpoint.merged_export import export_merged
from lightning_frozen.checkpoint.peft_export import export_peft_adapter
from lightning_frozen.errors import (
    BaseFolderError,
    BitsAndBytesConfigError,
    CheckpointFormatError,
    CheckpointKeysError,
    CheckpointNotFoundError,
    DependencyDriftError,
    ForeignParametersError,
    FrozenBaseFileError,
    FrozenBaseMismatchError,
    FrozenDtypeError,
    FrozenSetChangedError,
    FrozenTrainingError,
    InvalidArgumentTypeError,
    InvalidArgumentValueError,
    NoTrainableParametersError,
    OutputDirectoryError,
    SchedulerGroupsError,
    UnsupportedConfigurationError,
    UnsupportedOffloadOptimizerError,
)
from lightning_frozen.finetuning import BackboneFinetuning, BaseFinetuning
from lightning_frozen.memory import MemoryEstimate, estimate_memory
from lightning_frozen.strategy import FrozenAwareDeepSpeedStrategy
from lightning_frozen.zero.whole import unshard

__version__ = "0.1.0"

__all__ = [
    "BackboneFinetuning",
    "BaseFolderError",
    "BaseFinetuning",
    "BitsAndBytesConfigError",
    "CheckpointFormatError",
    "CheckpointKeysError",
    "CheckpointNotFoundError",
    "DependencyDriftError",
    "ForeignParametersError",
    "FrozenAwareDeepSpeedStrategy",
    "FrozenBaseFileError",
    "FrozenBaseMismatchError",
    "FrozenDtypeError",
    "FrozenSetChangedError",
    "FrozenTrainingError",
    "InvalidArgumentTypeError",
    "InvalidArgumentValueError",
    "MemoryEstimate",
    "NoTrainableParametersError",
    "OutputDirectoryError",
    "SchedulerGroupsError",
    "UnsupportedConfigurationError",
    "UnsupportedOffloadOptimizerError",
    "convert_deepspeed_checkpoint",
    "estimate_memory",
    "export_merged",
    "export_peft_adapter",
    "load_adapter",
    "load_from_checkpoint",
    "read_checkpoint",
    "unshard",
]

if "frozen_deepspeed" not in StrategyRegistry:
    FrozenAwareDeepSpeedStrategy.register_strategies(StrategyRegistry)
