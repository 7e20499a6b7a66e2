"""Fit ``--fits`` fresh Trainers and modules one after another in this process, as a sweep or a notebook does, the
last one raising mid-forward with ``--raise-last``; write ``<report>/rank0.json`` with host memory after each run
(after ``gc``), whether each run's module, engine and a frozen shard are still alive, and the functions of torch,
DeepSpeed, transformers and PEFT whose objects differ from before the first run. ``--then`` starts the arguments of
a next such series in the same process, measured from its own first run."""

from __future__ import annotations

import argparse
import gc
import sys
import types
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# imported before the functions are recorded, as the first engine's optimizer check imports it: DeepSpeed's Muon is
# decorated with torch.compile, and torch's dynamo then wraps torch.jit.trace and every optimizer's _init_group for
# good (TorchPatcher.patch): torch's own doing at an import, not a run's (the strategy imported it when built before)
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402, F401
import peft  # noqa: E402, F401
import psutil  # noqa: E402
import torch  # noqa: E402
import transformers.modeling_utils  # noqa: E402, F401
from torch import nn  # noqa: E402

from tests.distributed import runs_of, write_report  # noqa: E402
from tests.models import AdapterModel, LoRALinear, cpu_trainer, regression_data  # noqa: E402

PATCHED_PACKAGES = ("torch", "deepspeed", "transformers", "peft")
WIDTH, DEPTH = 1024, 12  # a frozen base of 48 MiB in fp32


class BuiltInConfigureModel(AdapterModel):
    """``AdapterModel`` whose layers are built in ``configure_model``, under the strategy's ``zero.Init`` and its
    transformers and PEFT patches; it raises in the forward of its last layer at step 2 when ``fail``."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(width=WIDTH, depth=0)
        self.fail, self.steps = fail, 0

    def configure_model(self) -> None:
        self.layers = nn.ModuleList(LoRALinear(WIDTH, 4) for _ in range(DEPTH))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if self.fail and self.steps == 2 and index == DEPTH // 2:
                raise RuntimeError("raised mid-forward")
        return self.head(x)


def functions() -> dict[str, int]:
    """The id of every function and class member of the loaded modules of :data:`PATCHED_PACKAGES`, by name."""
    found: dict[str, int] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(PATCHED_PACKAGES) or not isinstance(module, types.ModuleType):
            continue
        for attribute, value in list(vars(module).items()):
            if callable(value):
                found[f"{name}.{attribute}"] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                for member, function in list(vars(value).items()):
                    if callable(function):
                        found[f"{name}.{attribute}.{member}"] = id(function)
    return found


def host_mib() -> dict[str, float]:
    gc.collect()
    info = psutil.Process().memory_full_info()
    return {"uss": info.uss / 2**20, "rss": info.rss / 2**20}


def main() -> None:
    for arguments in runs_of(sys.argv[1:]):
        series(arguments)


def series(arguments: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("report", type=Path)
    parser.add_argument("--fits", type=int, default=5)
    parser.add_argument("--raise-last", action="store_true")
    args = parser.parse_args(arguments)
    before = functions()
    memory, alive, raised = [], [], None
    for run in range(args.fits):
        fail = args.raise_last and run == args.fits - 1
        model, trainer = BuiltInConfigureModel(fail), cpu_trainer(max_steps=3)
        try:
            trainer.fit(model, regression_data(width=WIDTH))
        except RuntimeError as error:
            raised = str(error)
        held = [weakref.ref(model), weakref.ref(trainer.strategy.model), weakref.ref(model.layers[0].base.weight)]
        held.append(weakref.ref(model.layers[0].base.weight.ds_tensor))
        alive.append(held)
        del model, trainer
        memory.append(host_mib())
    after = functions()
    changed = sorted(name for name, identity in before.items() if after.get(name, identity) != identity)
    report = {"memory": memory, "alive": [[ref() is not None for ref in held] for held in alive]}
    write_report(args.report, 0, {**report, "changed": changed, "raised": raised})


if __name__ == "__main__":
    main()
