"""The merged export's plan and its pass (``checkpoint/merge_plan.py``) and the one
safetensors format they write with (``base/slice_reads.py``). The export's behaviour is held by
``tests/test_merged_export.py``; here, what the flow's split promises (issue 62)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from safetensors import safe_open

import lightning_frozen
from lightning_frozen.base import slice_reads

PACKAGE = Path(lightning_frozen.__file__).parent
# what PEFT's layers hold, which only hf/ may name
PEFT_INTERNALS = ("original_module", "get_delta_factors", "parameter_name", "get_base_layer", "base_layer")


def _imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_plan_and_the_writer_know_nothing_of_peft_or_transformers() -> None:
    planned = [PACKAGE / "checkpoint" / "merge_plan.py"]
    for path in [*planned, PACKAGE / "format" / "merged_parts.py"]:
        imported = _imported(path)
        assert not {m for m in imported if m.split(".")[0] in ("peft", "transformers")}, path
        assert not {m for m in imported if m.startswith("lightning_frozen.hf")}, path
    for path in [*planned, PACKAGE / "checkpoint" / "merged_export.py"]:
        code = path.read_text()
        assert [name for name in PEFT_INTERNALS if name in code] == [], path


def test_a_written_header_is_read_back_by_safetensors_and_the_folder_index(tmp_path: Path) -> None:
    tensors = {
        "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1, 2, 3], dtype=torch.int64),
        "c.bias": torch.ones(5, dtype=torch.bfloat16),
    }
    path = tmp_path / slice_reads.WEIGHTS_NAME
    with open(path, "wb") as file:
        file.write(slice_reads.header_bytes((name, t.dtype, tuple(t.shape)) for name, t in tensors.items()))
        for value in tensors.values():
            file.write(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    with safe_open(str(path), "pt") as opened:
        assert sorted(opened.keys()) == sorted(tensors)
        for name, value in tensors.items():
            assert torch.equal(opened.get_tensor(name), value), name
    index = slice_reads.FolderIndex.of_folder(tmp_path)
    assert sorted(tensors, key=index.order) == list(tensors)  # the order they were written in
    for name, value in tensors.items():
        source = index.source(tuple(value.shape), [(name, 0)])
        assert torch.equal(source.read(0, value.numel()), value.reshape(-1)), name
