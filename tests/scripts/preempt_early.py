"""Send SIGTERM to ranks of a 2-process ``frozen_deepspeed`` fit before its first training step, where no step boundary
can be reached: in ``configure_model`` (a load standing in for a long one: the rank signals itself, then sleeps 120 s),
in the fingerprint (the first pass over the frozen shards at the start of training), or in sanity validation (then
sleeps likewise). ``--ranks`` says which ranks are signalled; the others sleep at the same point, as a rank that never
got the signal would go on loading. Each rank that leaves by itself writes ``<report>/rank<R>.json`` with its exit
status and how long it took from the signal; no checkpoint may appear in ``--dir``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
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
        time.sleep(120)  # the long load (or evaluation) the signal arrives in

    def configure_model(self) -> None:
        self._signal_then_wait("configure_model")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.sanity_checking:
            self._signal_then_wait("sanity")
        super().validation_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--at", choices=["configure_model", "fingerprint", "sanity"], required=True)
    parser.add_argument("--ranks", type=lambda text: [int(r) for r in text.split(",")], default=[0, 1])
    parser.add_argument("--grace", type=float, default=15.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the suite was started under

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
        trainer.fit(model, regression_data(), regression_data())
    except SystemExit as stop:
        status = stop.code
        raise
    except BaseException:
        status = 1
        raise
    finally:
        took = time.monotonic() - SIGNALLED_AT.get("time", time.monotonic())
        write_report(Path(args.report), trainer.global_rank, {"status": status, "seconds": took})


if __name__ == "__main__":
    main()
