"""Send SIGTERM to ranks of a 2-process ``frozen_deepspeed`` fit before its first training step, where no step boundary
can be reached: in the user's ``setup()``, in ``configure_model``, in ``on_fit_start``, in the fingerprint (the first
pass over the frozen shards at the start of training), in sanity validation (after the batch's forward: a rank
signalled alone that waits in a gather for one that was not is ended by the watchdog), in ``train_dataloader()``, or
inside the window in which transformers' loader is patched (``patch``: between the two patched functions, where the
script's own hook signals and sleeps 2 s, the window widened). A signalled rank goes on for ``--load`` seconds (the
rest of a load or an evaluation: the handler only records the signal) and then reaches the strategy's next boundary,
which raises the stop; a load longer than the grace is ended by the watchdog. ``--ranks`` says which ranks are
signalled; the others sleep 120 s at the same point, as a rank that never got the signal would go on loading. Each
rank that leaves by itself writes ``<report>/rank<R>.json`` with its exit status, how long it took from the signal,
and the patched functions that were not their originals after the run; no checkpoint may appear in ``--dir``.
``--slow-exit`` makes rank 0 end 6 s after its report, so that the rank it launched has ended long before.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from lightning_frozen.hf import transformers_loading  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402

SIGNALLED_AT: dict[str, float] = {}


class Signalling(AdapterModel):
    args: argparse.Namespace  # set after construction, so that it stays out of the hyper-parameters

    def _signal_then_wait(self, at: str) -> None:
        if self.args.at != at:
            return
        SIGNALLED_AT["time"] = time.monotonic()
        if self.global_rank in self.args.ranks:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(self.args.load)  # the rest of the load (or evaluation) the signal arrives in
        else:
            time.sleep(120)  # a rank that never got the signal goes on loading

    def setup(self, stage: str) -> None:
        self._signal_then_wait("setup")

    def configure_model(self) -> None:
        self._signal_then_wait("configure_model")

    def on_fit_start(self) -> None:
        self._signal_then_wait("on_fit_start")

    def train_dataloader(self) -> Any:
        self._signal_then_wait("train_dataloader")
        return regression_data()

    def val_dataloader(self) -> Any:
        return regression_data()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        if self.trainer.sanity_checking:  # after the forward, whose gathers wait for every rank
            self._signal_then_wait("sanity")


def patched_functions() -> dict[str, Any]:
    """The functions the load's patch windows replace for a while: transformers' two loading steps, DeepSpeed's
    partitioning of a param built under ``zero.Init``, PEFT's adapter creation."""
    from deepspeed.runtime.zero.partition_parameters import Init
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import modeling_utils

    return {
        "PeftModel.__init__": PeftModel.__init__,
        "BaseTuner.inject_adapter": BaseTuner.inject_adapter,
        "modeling_utils.load_state_dict": modeling_utils.load_state_dict,
        "modeling_utils._load_state_dict_into_zero3_model": modeling_utils._load_state_dict_into_zero3_model,
        "Init._partition_param": Init._partition_param,
        "Init._zero_init_param": Init._zero_init_param,
    }


def signal_inside_the_patch_window(ranks: list[int]) -> None:
    """The test's hook: transformers' loader is patched in two steps, each a ``functools.partial``; the second call
    (the first function already patched) signals this rank and sleeps 2 s, a widened window."""
    calls = []

    def partial(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2 and int(os.environ.get("LOCAL_RANK", "0")) in ranks:
            SIGNALLED_AT["time"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)
        return functools.partial(*args, **kwargs)

    transformers_loading.functools = SimpleNamespace(**{**vars(functools), "partial": partial})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--report", required=True)
    phases = ["setup", "configure_model", "on_fit_start", "fingerprint", "sanity", "train_dataloader", "patch"]
    parser.add_argument("--at", choices=phases, required=True)
    parser.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")], default=[0, 1])
    parser.add_argument("--grace", type=float, default=15.0)
    parser.add_argument("--load", type=float, default=2.0, help="seconds a signalled rank goes on after the signal")
    parser.add_argument("--slow-exit", action="store_true", help="rank 0 ends 6 s after the rank it launched")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the suite was started under

    originals = patched_functions()
    if args.at == "patch":
        signal_inside_the_patch_window(args.ranks)
    strategy = FrozenAwareDeepSpeedStrategy(preemption_grace=args.grace)
    if args.at == "fingerprint":
        fingerprint = strategy.frozen_base_fingerprint

        def signalled_fingerprint(*positional: Any, **named: Any) -> Any:
            model._signal_then_wait("fingerprint")
            return fingerprint(*positional, **named)

        strategy.frozen_base_fingerprint = signalled_fingerprint
    trainer = cpu_trainer(
        strategy,
        devices=2,
        max_steps=3,
        callbacks=[ModelCheckpoint(dirpath=args.dir, every_n_train_steps=1)],
        enable_checkpointing=True,
        num_sanity_val_steps=1,
    )
    model = Signalling()
    model.args = args
    status = 0
    try:
        trainer.fit(model)
    except SystemExit as stop:
        status = stop.code
        raise
    except BaseException:
        status = 1
        raise
    finally:
        took = time.monotonic() - SIGNALLED_AT.get("time", time.monotonic())
        left = sorted(name for name, function in patched_functions().items() if function is not originals[name])
        write_report(Path(args.report), trainer.global_rank, {"status": status, "seconds": took, "patched": left})
        if args.slow_exit and trainer.global_rank == 0:
            time.sleep(6)  # a teardown slower than the other rank's: Lightning's observer polls every 5 s


if __name__ == "__main__":
    main()
