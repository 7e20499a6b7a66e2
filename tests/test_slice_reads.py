"""base/slice_reads.py: a rank's flat slices of safetensors tensors, read by positioned reads one tensor ahead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lightning_frozen
from lightning_frozen.base import slice_reads

TENSORS = {
    "matrix": torch.arange(7 * 5 * 3).reshape(7, 5, 3).float(),
    "vector": torch.arange(11.0),
    "narrow": torch.randn(6, 9, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    "half": torch.randn(13, generator=torch.Generator().manual_seed(1)).half(),
    "ids": torch.arange(-5, 5, dtype=torch.int64),
    "mask": torch.tensor([True, False, True, True]),
    "scalar": torch.tensor(2.5),
}


def _file(tmp_path: Path) -> str:
    path = str(tmp_path / "t.safetensors")
    save_file(TENSORS, path, metadata={"format": "pt"})
    return path


def _ranges(numel: int) -> list[tuple[int, int]]:
    wanted = [(0, 1), (0, numel), (numel // 3, numel // 2), (numel - 1, 1), (numel, 0)]
    return [(start, min(count, numel - start)) for start, count in wanted]


def test_a_slice_holds_exactly_the_asked_elements_in_the_files_dtype(tmp_path: Path) -> None:
    path = _file(tmp_path)
    for key, tensor in TENSORS.items():
        flat = tensor.reshape(-1)
        for start, count in _ranges(flat.numel()):
            got = slice_reads.read_slice(slice_reads.SliceRead(path, key, start, count))
            assert got.dtype == tensor.dtype, key
            assert torch.equal(got, flat[start : start + count]), (key, start, count)


def test_read_ahead_yields_every_slice_in_order_across_files(tmp_path: Path) -> None:
    first = _file(tmp_path)
    second = str(tmp_path / "u.safetensors")
    other = {"w": torch.arange(100.0).reshape(10, 10)}
    save_file(other, second)
    reads = [
        slice_reads.SliceRead(second, "w", 50, 50),
        slice_reads.SliceRead(first, "narrow", 27, 27),
        slice_reads.SliceRead(second, "w", 0, 50),
        slice_reads.SliceRead(first, "mask", 1, 3),
    ]
    expected = [other["w"].reshape(-1)[50:], TENSORS["narrow"].reshape(-1)[27:], other["w"].reshape(-1)[:50]]
    expected.append(TENSORS["mask"][1:])
    with slice_reads.read_ahead(reads) as slices:
        got = list(slices)
    assert len(got) == len(expected)
    for values, wanted in zip(got, expected):
        assert torch.equal(values, wanted)


def test_the_folder_index_reads_each_file_from_start_to_end(tmp_path: Path) -> None:
    path = _file(tmp_path)
    index = slice_reads.FolderIndex([path])
    ordered = sorted(TENSORS, key=index.order)
    offsets = [index.tensors[key][1].offset for key in ordered]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(TENSORS)
    assert index.tensors["matrix"][1].nbytes == TENSORS["matrix"].numel() * 4


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = _file(tmp_path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:-8])
    with pytest.raises(lightning_frozen.FrozenBaseFileError, match="t.safetensors") as raised:
        slice_reads.read_slice(slice_reads.SliceRead(path, "vector", 0, 11))
    assert "before tensor" in str(raised.value)


def test_a_cut_header_is_named(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    path.write_bytes(Path(_file(tmp_path)).read_bytes()[:40])
    with pytest.raises(lightning_frozen.FrozenBaseFileError, match="cut.safetensors"):
        slice_reads.read_header(str(path))


def test_a_read_error_is_raised_where_its_slice_is_taken_and_the_files_close(tmp_path: Path) -> None:
    path = _file(tmp_path)
    missing = str(tmp_path / "gone.safetensors")
    reads = [slice_reads.SliceRead(path, "vector", 0, 11), slice_reads.SliceRead(missing, "w", 0, 1)]
    with pytest.raises(FileNotFoundError), slice_reads.read_ahead(reads) as slices:
        assert torch.equal(next(slices), TENSORS["vector"])
        next(slices)
