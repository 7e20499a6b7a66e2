"""Train a ``tests.models.AdapterModel`` (4 layers; its ``training_step`` calls ``self(x)``) over an NF4 base on N
CPU processes, three times: as shipped (``shared``: the ranks share one machine, so each reads the others' codes from
shared memory, ``zero/compute/frozen_files.py``); then with the codes exchanged through the process group, as ranks on
several machines do, with the quantized gather asynchronous (``async``: DeepSpeed's coordinator prefetches through its
handle) and with every gather's collective waited on inside the call (``sync``). Each rank writes
``<out>/<run>/rank<R>.json``. ``train_quantized.py --prefetch-out`` runs the three in its own world after its fits.

Then the shared file's failures: a handshake whose process group raises once rank 0 has made the file
(``raising-handshake``); and, given ``--small-shm`` (a tmpfs too small for the codes, mounted by the caller), a fit
whose shared folder it is (``small-shm``), after rank 0 left in it files named as a dead job's, a live job's and
another user's would be (``small-shm-planted.json``).

Every gather is recorded (``tests.gather_recording``): whether it was started with ``async_op=True``, and how many
frozen layers' forwards began between its start and the wait on its work. A gather that DeepSpeed prefetched and
that stayed in flight while another layer computed shows a count above zero.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed.comm  # noqa: E402
import torch  # noqa: E402

from lightning_frozen import FrozenAwareDeepSpeedStrategy, process  # noqa: E402
from lightning_frozen.zero import frozen_files, frozen_storage  # noqa: E402
from lightning_frozen.zero import params as zero  # noqa: E402
from lightning_frozen.zero.compute import quantized  # noqa: E402
from tests.distributed import write_report  # noqa: E402
from tests.gather_recording import GatherRecorder  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402

WIDTH, DEPTH = 128, 4


def fit(run: str, devices: int, out: Path, recorder: GatherRecorder, code_cache: Any = True) -> AdapterModel:
    recorder.reset()
    model = AdapterModel(width=WIDTH, depth=DEPTH)
    seen: dict[str, torch.Tensor] = {}

    def keep_last_call(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen["input"], seen["output"] = inputs[0].detach().clone(), output.detach().clone()

    for layer in model.layers:
        recorder.watch(layer.base)
    model.layers[DEPTH - 1].base.register_forward_hook(keep_last_call)
    trainer = cpu_trainer(
        FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4", code_cache=code_cache),
        devices=devices,
        max_epochs=1,
        precision="bf16-true",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, regression_data(width=WIDTH))
    trainable = {n: zero.full_param(p).float().tolist() for n, p in model.named_parameters() if p.requires_grad}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    pids: list[Optional[int]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(pids, os.getpid())
    # this run's files only: other jobs on the machine may share codes in /dev/shm at the same time
    ours = tuple(f"{frozen_files._PREFIX}-{process.pid_space_tag()}-{pid}-" for pid in pids)
    report = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "frozen_params": len(frozen),
        "shared_params": sum(frozen_files.rows_of(p) is not None for p in frozen),
        "shards_are_their_rows": [  # each rank's shard of a shared param is its row of the shared file
            frozen_files.rows_of(p)[trainer.global_rank].data_ptr() == p.ds_tensor.data_ptr()
            for p in frozen
            if frozen_files.rows_of(p) is not None
        ],
        "exchange_warnings": [
            str(w.message) for w in caught if "exchanged through the process group" in str(w.message)
        ],
        "shared_files_left": sorted(f.name for f in frozen_files.SHARED_DIR.glob(f"{frozen_files._PREFIX}-*")),
        "own_files_left": sorted(f.name for f in frozen_files.SHARED_DIR.iterdir() if f.name.startswith(ours)),
        "gathers": recorder.gathers,
        "trainable": trainable,
        "seen_input": seen["input"].float().tolist(),
        "seen_output": seen["output"].float().tolist(),
    }
    write_report(out / run, trainer.global_rank, report)
    torch.distributed.barrier()
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--small-shm", help="a tmpfs too small for the codes: then a fit that shares codes there")
    args = parser.parse_args()
    fit_both(args.devices, Path(args.out), Path(args.small_shm) if args.small_shm else None)


def fit_both(devices: int, out: Path, small_shm: Optional[Path] = None) -> None:
    """The shared run, then the asynchronous and the synchronous ones (the gather patched, and put back after); then
    the failures of the shared file."""
    recorder = GatherRecorder()
    fit("shared", devices, out, recorder)
    with ranks_on_separate_machines(out):
        model = fit_exchanging(devices, out, recorder)
    share_in_a_handshake_that_raises(model, out / "raising-handshake")
    if small_shm is not None:
        if torch.distributed.get_rank() == 0:
            leave_files_of_other_jobs(small_shm, out / "small-shm-planted.json")
        with shared_dir(small_shm):
            fit("small-shm", devices, out, recorder, code_cache=False)  # no folder on disk to share them in
            fit("spilled", devices, out, recorder, code_cache=out / "spill")


@contextmanager
def ranks_on_separate_machines(out: Path) -> Iterator[None]:
    """While active, each rank looks for the shared file in a folder of its own, as ranks on separate machines would:
    the others do not find the file rank 0 made, and the ranks exchange codes through the process group."""
    with shared_dir(out / f"shared-dir-rank{os.environ.get('LOCAL_RANK', '0')}"):  # set in the ranks Lightning starts
        yield


@contextmanager
def shared_dir(folder: Path) -> Iterator[None]:
    """While active, the shared file is made in ``folder`` instead of ``/dev/shm``."""
    folder.mkdir(parents=True, exist_ok=True)
    shared, frozen_files.SHARED_DIR = frozen_files.SHARED_DIR, folder
    try:
        yield
    finally:
        frozen_files.SHARED_DIR = shared


def share_in_a_handshake_that_raises(model: AdapterModel, folder: Path) -> None:
    """Share ``model``'s frozen codes (exchanged through the process group until now) in ``folder``, with a process
    group that raises on every rank once rank 0 has made the file, as when another rank dies; report what is left."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    report: dict[str, Any] = {"raised": None}

    def dying(*args: Any, **kwargs: Any) -> None:
        report["files_at_the_raise"] = sorted(f.name for f in folder.glob("lightning-frozen-*"))
        raise RuntimeError("a rank died")

    broadcast, deepspeed.comm.broadcast_object_list = deepspeed.comm.broadcast_object_list, dying
    try:
        with shared_dir(folder):
            frozen_files.share_codes(frozen, frozen_storage.frozen_dtype_of)
    except RuntimeError as error:
        report["raised"] = str(error)
        # while the traceback (and the frame of `share_codes`) is still alive
        report["mapped_after"] = [
            line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line
        ]
    finally:
        deepspeed.comm.broadcast_object_list = broadcast
    # once every rank has left `share_codes`: rank 1's raise does not wait for rank 0, the file's maker and remover,
    # and a look before this barrier found rank 0's file still there under load (issue 63)
    torch.distributed.barrier()
    report["files_left"] = sorted(f.name for f in folder.glob("lightning-frozen-*"))
    report["shared_params"] = sum(frozen_files.rows_of(p) is not None for p in frozen)
    write_report(folder, torch.distributed.get_rank(), report)
    torch.distributed.barrier()


def leave_files_of_other_jobs(folder: Path, planted: Path) -> None:
    """Files in ``folder`` named as the shared files of a dead job of this pid space, a live one, a job of another
    pid space (another container's, which this one cannot tell dead), and one named as a dead job's here but owned
    by another user (where this process may chown); their names by kind, in ``planted``."""
    uid, space = os.getuid(), process.pid_space_tag()
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid is no longer alive
    names = {
        "dead": f"lightning-frozen-{space}-{ended.pid}-000000aa",
        "live": f"lightning-frozen-{space}-{os.getppid()}-000000bb",
        "other_space": f"lightning-frozen-{'0' * 16}-{ended.pid}-000000cc",
        "other_owner": f"lightning-frozen-{space}-{ended.pid}-000000dd",
    }
    for name in names.values():
        (folder / name).touch()
    try:
        os.chown(folder / names["other_owner"], uid + 1, -1)
    except OSError:  # not root here: the name check alone is tested
        (folder / names.pop("other_owner")).unlink()
    planted.write_text(json.dumps(names))


def fit_exchanging(devices: int, out: Path, recorder: GatherRecorder) -> AdapterModel:
    """The asynchronous fit, then the synchronous one; the synchronous one's model."""
    fit("async", devices, out, recorder)

    asynchronous = quantized._gather

    def synchronous(params: list, tables: Any, for_layer: bool = False) -> Any:
        handle = asynchronous(params, tables, for_layer)
        for _, work in handle.groups:  # the collective completes inside the call; `wait` only decodes
            if work is not None:
                work.wait()
        return handle

    quantized._gather = synchronous
    try:
        return fit("sync", devices, out, recorder)
    finally:
        quantized._gather = asynchronous


if __name__ == "__main__":
    main()
