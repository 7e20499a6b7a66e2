"""Train a ``tests.models.AdapterModel`` (4 layers; its ``training_step`` calls ``self(x)``) over an NF4 base on N
CPU processes, three times: as shipped (``shared``: the ranks share one machine, so each reads the others' codes from
shared memory, ``zero/node_codes.py``); then with the codes exchanged through the process group, as ranks on several
machines do, with the quantized gather asynchronous (``async``: DeepSpeed's coordinator prefetches through its
handle) and with every gather's collective waited on inside the call (``sync``). Each rank writes
``<out>/<run>/rank<R>.json``. ``train_quantized.py --prefetch-out`` runs the three in its own world after its fits.

Every gather is recorded (``tests.gather_recording``): whether it was started with ``async_op=True``, and how many
frozen layers' forwards began between its start and the wait on its work. A gather that DeepSpeed prefetched and
that stayed in flight while another layer computed shows a count above zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy  # noqa: E402
from lightning_frozen.zero import node_codes, quantized  # noqa: E402
from lightning_frozen.zero import params as zero  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.gather_recording import GatherRecorder  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402

WIDTH, DEPTH = 128, 4


def fit(run: str, devices: int, out: Path, recorder: GatherRecorder) -> None:
    recorder.reset()
    model = AdapterModel(width=WIDTH, depth=DEPTH)
    seen: dict[str, torch.Tensor] = {}

    def keep_last_call(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen["input"], seen["output"] = inputs[0].detach().clone(), output.detach().clone()

    for layer in model.layers:
        recorder.watch(layer.base)
    model.layers[DEPTH - 1].base.register_forward_hook(keep_last_call)
    trainer = cpu_trainer(
        FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4"), devices=devices, max_epochs=1, precision="bf16-true"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, regression_data(width=WIDTH))
    trainable = {n: zero.full_param(p).float().tolist() for n, p in model.named_parameters() if p.requires_grad}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    report = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "frozen_params": len(frozen),
        "shared_params": sum(node_codes.rows_of(p) is not None for p in frozen),
        "shards_are_their_rows": [  # each rank's shard of a shared param is its row of the shared file
            node_codes.rows_of(p)[trainer.global_rank].data_ptr() == p.ds_tensor.data_ptr()
            for p in frozen
            if node_codes.rows_of(p) is not None
        ],
        "exchange_warnings": [
            str(w.message) for w in caught if "exchanged through the process group" in str(w.message)
        ],
        "shared_files_left": sorted(f.name for f in node_codes.SHARED_DIR.glob("lightning-frozen-*")),
        "gathers": recorder.gathers,
        "trainable": trainable,
        "seen_input": seen["input"].float().tolist(),
        "seen_output": seen["output"].float().tolist(),
    }
    write_report(out / run, trainer.global_rank, report)
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fit_both(args.devices, Path(args.out))


def fit_both(devices: int, out: Path) -> None:
    """The shared run, then the asynchronous and the synchronous ones (the gather patched, and put back after)."""
    recorder = GatherRecorder()
    fit("shared", devices, out, recorder)
    with ranks_on_separate_machines(out):
        fit_exchanging(devices, out, recorder)


@contextmanager
def ranks_on_separate_machines(out: Path) -> Iterator[None]:
    """While active, each rank looks for the shared file in a folder of its own, as ranks on separate machines would:
    the others do not find the file rank 0 made, and the ranks exchange codes through the process group."""
    folder = out / f"shared-dir-rank{os.environ.get('LOCAL_RANK', '0')}"  # set in the processes Lightning starts
    folder.mkdir(parents=True, exist_ok=True)
    shared_dir, node_codes.SHARED_DIR = node_codes.SHARED_DIR, folder
    try:
        yield
    finally:
        node_codes.SHARED_DIR = shared_dir


def fit_exchanging(devices: int, out: Path, recorder: GatherRecorder) -> None:
    fit("async", devices, out, recorder)

    asynchronous = quantized._gather

    def synchronous(params: list, for_layer: bool = False) -> Any:
        handle = asynchronous(params, for_layer)
        for _, work in handle.groups:  # the collective completes inside the call; `wait` only decodes
            if work is not None:
                work.wait()
        return handle

    quantized._gather = synchronous
    try:
        fit("sync", devices, out, recorder)
    finally:
        quantized._gather = asynchronous


if __name__ == "__main__":
    main()
