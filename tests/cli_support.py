"""What the CLI and example tests share: classes they name by ``class_path`` (the regression data as a
LightningDataModule, an adapter model that saves its hyper-parameters as a LightningCLI user's module would, and
modules whose ``__init__`` fails) and the environment for commands they run in subprocesses."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

import lightning_frozen
from tests.distributed import fresh_env
from tests.models import AdapterModel, regression_data


class RegressionData(L.LightningDataModule):
    """``regression_data`` for training and validation."""

    def __init__(self, width: int = 32, samples: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        self.width = width
        self.samples = samples
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return regression_data(self.width, self.samples, self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return regression_data(self.width, self.samples // 2, self.batch_size, seed=2)


class SavedHparamsAdapterModel(AdapterModel):
    """``AdapterModel`` calling ``save_hyperparameters``, so the CLI records its class path and arguments."""

    def __init__(self, width: int = 32, depth: int = 2, rank: int = 4, lr: float = 1e-2, seed: int = 0) -> None:
        super().__init__(width=width, depth=depth, rank=rank, lr=lr, seed=seed)
        self.save_hyperparameters()


class AdapterFromFile(SavedHparamsAdapterModel):
    """Starts from the trained adapter in the file ``adapter``, loaded in ``__init__``."""

    def __init__(self, adapter: str, width: int = 32) -> None:
        super().__init__(width=width)
        lightning_frozen.load_adapter(self, adapter)


class BuggyAdapterModel(SavedHparamsAdapterModel):
    """A module with a bug of its own in ``__init__``."""

    def __init__(self, width: int = 32) -> None:
        super().__init__(width=width)
        self.sizes = {"width": width}["depth"]


def command_env() -> dict[str, str]:
    """:func:`fresh_env` without ``PYTHONPATH``: commands import from their working directory."""
    return {key: value for key, value in fresh_env().items() if key != "PYTHONPATH"}
