"""A save gathers each trainable tensor to rank 0 alone, one at a time, into a file written in two passes (issue 38):
the file is what ``torch.save`` writes, its tensors bit-equal to what DeepSpeed's own accessors gather; hooks may move
or drop the placeholders; a failed write ends no other rank's save; a resume maps the file and reads its own part.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import lightning_frozen
from lightning_frozen.checkpoint import file
from lightning_frozen.errors import CheckpointFormatError
from lightning_frozen.zero import torch_file
from tests.distributed import read_reports, run_script
from tests.models import AdapterModel, cpu_trainer, regression_data


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(found: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert (found.dtype, found.shape) == (expected.dtype, expected.shape), what
    assert torch.equal(_bytes(found), _bytes(expected)), what


# ---------------------------------------------------------------------------------------------- the two passes


def _write_in_two_passes(
    path: Path, obj: Any, later: list[torch.Tensor], values: list[torch.Tensor], order: list[int]
) -> None:
    def fill(put: torch_file.Put) -> None:
        for index in order:
            put(later[index], values[index])

    with open(path, "w+b") as handle:
        torch_file.save_in_two_passes(obj, handle, later, fill)


def test_a_file_written_in_two_passes_loads_as_torch_save_wrote_it(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    values = [
        torch.randn(3, 7, generator=generator),
        torch.randn(5, generator=generator).to(torch.bfloat16),
        torch.randn(2**20 + 3, generator=generator),  # several pages, an odd size
        torch.randn((), generator=generator),
    ]
    later = [torch.empty_like(v, device="meta") for v in values]
    shared = torch.arange(10.0)
    obj = {
        "state_dict": {"a": later[0], "b": later[1], "buffer": torch.ones(4)},
        "optimizer_states": [{"state": {"a": {"exp_avg": later[2], "step": torch.tensor(3.0)}}, "lr": 0.1}],
        "moved by a hook": {"scalar": later[3]},
        "views": (shared[2:5], shared[::3]),
        "text": "s",
    }
    _write_in_two_passes(tmp_path / "two.pt", obj, later, values, order=[2, 0, 3, 1])
    expected = torch_file.with_values(obj, {id(t): v for t, v in zip(later, values)})
    torch.save(expected, tmp_path / "one.pt")

    loaded, reference = (torch.load(tmp_path / n, weights_only=True) for n in ("two.pt", "one.pt"))
    assert zipfile.ZipFile(tmp_path / "two.pt").testzip() is None  # every record's CRC-32 is back
    leaves = [(loaded, reference, "")]
    while leaves:
        found, wanted, where = leaves.pop()
        if torch.is_tensor(wanted):
            assert_bit_equal(found, wanted, where)
        elif isinstance(wanted, (dict, list, tuple)):
            keys = wanted.keys() if isinstance(wanted, dict) else range(len(wanted))
            assert type(found) is type(wanted) and len(found) == len(wanted), where
            leaves += [(found[k], wanted[k], f"{where}/{k}") for k in keys]
        else:
            assert found == wanted, where
    assert torch.equal(loaded["views"][1], shared[::3])  # views of one storage come back as views of one storage
    mapped = torch.load(tmp_path / "two.pt", weights_only=True, mmap=True)
    assert_bit_equal(mapped["optimizer_states"][0]["state"]["a"]["exp_avg"], values[2], "mmap")


def test_a_meta_tensor_it_was_not_given_and_a_value_never_put_are_refused(tmp_path: Path) -> None:
    later = [torch.empty(3, device="meta")]
    stray = {"a": later[0], "b": torch.empty(2, device="meta")}
    with pytest.raises(CheckpointFormatError, match=r"tensor of shape \(2,\) on the meta device"):
        _write_in_two_passes(tmp_path / "x.pt", stray, later, [torch.ones(3)], order=[0])
    with pytest.raises(CheckpointFormatError, match="1 tensor"):
        _write_in_two_passes(tmp_path / "y.pt", {"a": later[0]}, later, [], order=[])
    with pytest.raises(CheckpointFormatError, match="dtype torch.float32 was given a value of shape"):
        _write_in_two_passes(tmp_path / "z.pt", {"a": later[0]}, later, [torch.ones(3, dtype=torch.int64)], [0])
    # a placeholder a hook dropped from the dict is gathered and skipped
    _write_in_two_passes(tmp_path / "w.pt", {"kept": 1}, later, [torch.ones(3)], order=[0])
    assert torch.load(tmp_path / "w.pt", weights_only=True) == {"kept": 1}


def test_the_first_pass_holds_none_of_the_bytes_still_to_come(tmp_path: Path) -> None:
    """Eight tensors of 64 MiB, each value made as it is put: the process's peak rises by about one of them, not by the
    tensors the structure reserves places for (their stand-ins' pages are never touched)."""
    result = run_script("two_pass_memory.py", f"--out={tmp_path / 'big.pt'}", "--tensors=8", "--mib=64")
    assert json.loads(result.stdout.splitlines()[-1])["peak_rise_mib"] < 2 * 64
    saved = torch.load(tmp_path / "big.pt", weights_only=True, mmap=True)["state_dict"]
    assert [float(saved[i][-1]) for i in range(8)] == [float(i) for i in range(8)]


# ---------------------------------------------------------------------------------------------- one rank


class Hooked(AdapterModel):
    """Drops ``layers.0.lora_b`` from the saved state in ``on_save_checkpoint``, or with ``compute`` puts a value
    computed from a placeholder there."""

    def __init__(self, compute: bool = False) -> None:
        super().__init__()
        self.compute = compute

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        placeholder = checkpoint["state_dict"].pop("layers.0.lora_b")
        checkpoint["renamed"] = {"lora_a": checkpoint["state_dict"]["layers.0.lora_a"]}
        if self.compute:
            checkpoint["state_dict"]["layers.0.lora_b"] = placeholder * 2


def test_hooks_may_move_and_drop_placeholders_but_not_compute_from_them(tmp_path: Path) -> None:
    trainer = cpu_trainer(max_steps=2)
    module = Hooked()
    trainer.fit(module, regression_data())
    trainer.save_checkpoint(tmp_path / "hooked.ckpt")
    saved = torch.load(tmp_path / "hooked.ckpt", weights_only=True)
    assert "layers.0.lora_b" not in saved["state_dict"] and "layers.0.lora_b" in saved["optimizer_states"][0]["state"]
    assert torch.equal(saved["renamed"]["lora_a"], saved["state_dict"]["layers.0.lora_a"])
    assert not torch.equal(saved["state_dict"]["layers.1.lora_b"], torch.zeros(32, 4))  # it trained, it is filled
    module.compute = True
    with pytest.raises(CheckpointFormatError, match="may move or drop their tensors, but not compute new ones"):
        trainer.save_checkpoint(tmp_path / "computed.ckpt")
    assert not (tmp_path / "computed.ckpt").exists()


class KeepsTensors(L.Callback):
    """A callback whose state holds a tensor, kept after the resume restores it."""

    def __init__(self) -> None:
        self.kept = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"kept": self.kept + 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.kept = state_dict["kept"]


def test_a_resume_maps_the_file_and_keeps_nothing_of_it_but_the_trainable_state(tmp_path: Path) -> None:
    trainer = cpu_trainer(max_steps=2, callbacks=[KeepsTensors()])
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    loaded = file.read_checkpoint(tmp_path / "a.ckpt")
    mapped = mapped_ranges(tmp_path / "a.ckpt")
    moments = [s["exp_avg"] for s in loaded["optimizer_states"][0]["state"].values()]
    assert moments and all(in_ranges(t, mapped) for t in [*loaded["state_dict"].values(), *moments])
    assert not any(in_ranges(t, mapped) for t in loaded["callbacks"]["KeepsTensors"].values())
    assert loaded["callbacks"]["KeepsTensors"]["kept"].tolist() == [1.0, 1.0, 1.0]
    del loaded, moments
    assert mapped_ranges(tmp_path / "a.ckpt") == []  # nothing holds the file once the trainable state goes


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps ``path`` (``/proc/self/maps``)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def in_ranges(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= tensor.data_ptr() < end for start, end in ranges)


# ---------------------------------------------------------------------------------------------- two ranks


@pytest.mark.slow
def test_two_ranks_write_each_tensor_bit_equal_to_deepspeeds_own_gather(tmp_path: Path) -> None:
    run_script("save_streamed.py", f"--out={tmp_path}", "--fail-write", timeout=400)
    saved = torch.load(tmp_path / "streamed.ckpt", weights_only=True)
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert zipfile.ZipFile(tmp_path / "streamed.ckpt").testzip() is None
    assert sorted(saved["state_dict"]) == sorted(reference["state_dict"])
    for name, value in reference["state_dict"].items():
        assert_bit_equal(saved["state_dict"][name], value, name)
    assert saved["state_dict"]["layers.0.lora_a"].dtype == torch.float32  # the fp32 master copy
    assert saved["state_dict"]["head.weight"].dtype == torch.bfloat16  # no optimizer group: the param itself
    assert {n: sorted(s) for n, s in saved["optimizer_states"][0]["state"].items()} == {
        n: sorted(s) for n, s in reference["state"].items()
    }
    for name, state in reference["state"].items():
        for key, value in state.items():
            assert_bit_equal(saved["optimizer_states"][0]["state"][name][key], value, f"{name} {key}")
    # rank 0's write failed after its first tensor: it raised, rank 1 came back, the previous file is whole
    failed, other = read_reports(tmp_path / "reports")
    assert "No space left" in failed["error"] and "error" not in other
    assert failed["previous_file_whole"] and failed["left_in_folder"] == ["streamed.ckpt"]
    # and the file resumes: lightning_frozen reads it back onto one rank
    module = lightning_frozen.load_adapter(AdapterModel(width=7, rank=3), tmp_path / "streamed.ckpt")
    assert torch.equal(module.layers[1].lora_a.detach(), reference["state_dict"]["layers.1.lora_a"])
