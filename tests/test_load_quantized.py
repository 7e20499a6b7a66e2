"""``frozen_dtype`` with ``from_pretrained`` in ``configure_model``: each rank encodes its slices as it reads them.

Checked against quantizing after loading (the path of bases that arrive another way), on 1 and 2 CPU ranks with
a Llama written by ``save_pretrained`` and PEFT LoRA with ``modules_to_save`` and a trainable base norm: the same
codes bit for bit, the same fingerprint, trainable params holding the file's exact values, and an exact resume."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import chained, read_reports, run_in_this_process, run_script
from tests.pretrained_support import write_llama

pytestmark = pytest.mark.slow  # each test loads and trains a Llama: 1 rank in this process, 2 in a subprocess world


def _runs(folder: Path, devices: int, *runs: tuple[Any, ...]) -> list[list[dict[str, Any]]]:
    """``load_quantized.py`` on ``devices`` ranks, one world for all ``runs`` (each its report folder, then its
    arguments): per run, each rank's report, with what every rank logged in that run as ``output``."""
    common = ("--folder", str(folder), "--devices", str(devices))
    arguments = [(*common, "--report", str(report), *args) for report, *args in runs]
    if devices == 1:
        run_in_this_process("load_quantized.py", *chained(*arguments))
    else:
        run_script("load_quantized.py", *chained(*arguments), timeout=600)
    found = []
    for report, *_ in runs:
        reports = read_reports(report)
        output = "\n".join(line for each in reports for line in each["logged"])
        found.append([{**each, "output": output} for each in reports])
    return found


def _run(folder: Path, report: Path, devices: int, *args: str) -> list[dict[str, Any]]:
    (reports,) = _runs(folder, devices, (report, *args))
    return reports


# under 32-true the bf16 file's values widen exactly into fp32 shards, and are encoded as read; both 2-rank cases run
# in one world (a 2-rank launch costs more than the runs in it)
@pytest.mark.parametrize(
    ("devices", "cases"),
    [
        (1, [("int8", "bf16-mixed")]),
        (1, [("bf16", "32-true")]),
        (2, [("nf4", "bf16-mixed"), ("nf4", "32-true")]),
    ],
    ids=["1-int8-bf16-mixed", "1-bf16-32-true", "2-nf4-bf16-mixed-and-32-true"],
)
def test_quantizing_while_loading_gives_the_codes_and_fingerprint_of_quantizing_after(
    devices: int, cases: list[tuple[str, str]], tmp_path: Path
) -> None:
    folder = write_llama(tmp_path / "llama")
    runs = []
    for frozen_dtype, precision in cases:
        common = ("--log-every", "-1", "--precision", precision)  # a progress line for every tensor
        case = tmp_path / f"{frozen_dtype}-{precision}"
        runs += [
            (case / "at_load", *common, "--frozen-dtype", frozen_dtype),
            (case / "after", *common, "--frozen-dtype", frozen_dtype, "--after"),
            (case / "bf16", *common),
        ]
    found = _runs(folder, devices, *runs)
    for index, (frozen_dtype, _) in enumerate(cases):
        _quantized_at_load_as_after(devices, frozen_dtype, *found[3 * index : 3 * index + 3])


def _quantized_at_load_as_after(
    devices: int,
    frozen_dtype: str,
    at_load: list[dict[str, Any]],
    after: list[dict[str, Any]],
    unquantized: list[dict[str, Any]],
) -> None:
    """Each rank's reports of one case: stored as ``frozen_dtype`` while loading, after loading, and not at all."""
    assert len(at_load) == devices
    for loaded, quantized_later, plain in zip(at_load, after, unquantized):
        assert loaded["quantized_at_load"] > 0 and quantized_later["quantized_at_load"] == 0
        assert {dtype for dtype, _ in loaded["codes"].values()} == {"torch.uint8"}
        assert loaded["codes"] == quantized_later["codes"]  # bit for bit, param by param, on every rank
        assert f"The frozen base was stored as {frozen_dtype} as it was read." in loaded["output"]
        assert "only at setup: until then the node held them in the compute dtype" in quantized_later["output"]
        # the fingerprint is of the source values, whichever way the base was loaded and stored
        assert loaded["fingerprint"] == quantized_later["fingerprint"] == plain["fingerprint"]
        assert plain["fingerprint"] == plain["fingerprint_by_a_pass"]
        # the lm_head copy (`modules_to_save`) and the norm train from the file's exact values, not from codes
        assert loaded["trainable_exact"] and all(loaded["trainable_exact"].values()), loaded["trainable_exact"]
        assert any("modules_to_save" in name for name in loaded["trainable_exact"])
        assert any(name.endswith("model.norm.weight") for name in loaded["trainable_exact"])
    # progress from rank 0 only, in order: one line per tensor however many ranks read it
    assert _percents(at_load[0]["output"], "lightning-frozen: loading the frozen base") == sorted(
        _percents(at_load[0]["output"], "lightning-frozen: loading the frozen base")
    )
    assert len(_percents(at_load[0]["output"], "lightning-frozen: loading the frozen base")) == 21
    fingerprinted = _percents(unquantized[0]["output"], "lightning-frozen: fingerprinting the frozen base")
    assert len(fingerprinted) == unquantized[0]["fingerprinted"] and fingerprinted == sorted(fingerprinted)
    assert fingerprinted[-1] == 100


def _percents(output: str, prefix: str) -> list[int]:
    lines = [line[line.index(prefix) :] for line in output.splitlines() if prefix in line]
    assert all("/s" in line for line in lines), lines
    return [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines]  # type: ignore[union-attr]


def test_a_bf16_file_loaded_into_fp32_records_the_fingerprint_of_a_separate_pass(tmp_path: Path) -> None:
    folder = write_llama(tmp_path / "llama")
    (report,) = _run(folder, tmp_path / "fp32", 1, "--precision", "32-true")
    assert report["quantized_at_load"] == 0
    assert {dtype for dtype, _ in report["codes"].values()} == {"torch.float32"}
    assert report["fingerprint"] == report["fingerprint_by_a_pass"]


def test_a_sha256_fingerprint_taken_while_loading_is_that_of_the_source_bytes(tmp_path: Path) -> None:
    folder = write_llama(tmp_path / "llama")
    common = (1, "--fingerprint", "sha256")
    (at_load,) = _run(folder, tmp_path / "at_load", *common, "--frozen-dtype", "nf4")
    (after,) = _run(folder, tmp_path / "after", *common, "--frozen-dtype", "nf4", "--after")
    (plain,) = _run(folder, tmp_path / "bf16", *common)
    assert at_load["quantized_at_load"] > 0
    assert at_load["fingerprint"] == after["fingerprint"] == plain["fingerprint"] == plain["fingerprint_by_a_pass"]


def test_a_run_quantized_while_loading_resumes_exactly(tmp_path: Path) -> None:
    folder = write_llama(tmp_path / "llama")
    common = (1, "--frozen-dtype", "nf4")
    _run(folder, tmp_path / "half", *common, "--max-epochs", "1", "--save", str(tmp_path / "half.ckpt"))
    resume = ("--resume", str(tmp_path / "half.ckpt"))
    _run(folder, tmp_path / "resumed", *common, "--max-epochs", "2", *resume, "--save", str(tmp_path / "resumed.ckpt"))
    _run(folder, tmp_path / "straight", *common, "--max-epochs", "2", "--save", str(tmp_path / "straight.ckpt"))
    resumed = torch.load(tmp_path / "resumed.ckpt", weights_only=True)
    straight = torch.load(tmp_path / "straight.ckpt", weights_only=True)
    assert resumed["global_step"] == straight["global_step"] == 4
    assert resumed["state_dict"].keys() == straight["state_dict"].keys()
    for name, value in straight["state_dict"].items():  # LoRA, the lm_head copy and the norm
        assert torch.equal(resumed["state_dict"][name], value), name
        for key, state in straight["optimizer_states"][0]["state"][name].items():
            assert torch.equal(resumed["optimizer_states"][0]["state"][name][key], state), (name, key)
    assert resumed["frozen_base"]["fingerprint"] == straight["frozen_base"]["fingerprint"]


def test_a_param_written_while_loading_is_encoded_and_fingerprinted_as_written(tmp_path: Path) -> None:
    # in this process, one rank: a write under GatheredParameters(modifier_rank=0) inside `configure_model`, where
    # zero.Init's tensor patches are still on, to a weight the loader already stored as int8 codes
    import deepspeed

    from lightning_frozen import FrozenAwareDeepSpeedStrategy
    from lightning_frozen.base import fingerprint
    from tests.models import cpu_trainer
    from tests.pretrained_support import PretrainedLoRA, token_data

    class WrittenWhileLoading(PretrainedLoRA):
        def configure_model(self) -> None:
            super().configure_model()
            weight = self.model.base_model.model.model.layers[0].mlp.down_proj.weight
            with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
                weight.data.copy_(torch.linspace(-1, 1, weight.numel()).view_as(weight))
                self.written = weight.detach().clone()  # in the compute dtype, as the write left it

    strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype="int8", fingerprint="sha256")
    trainer = cpu_trainer(strategy, max_steps=1, max_epochs=-1, precision="bf16-true")
    module = WrittenWhileLoading(str(write_llama(tmp_path / "llama")))
    trainer.fit(module, token_data())
    assert strategy._loaded_base.quantized_at_load > 0
    trainer.save_checkpoint(tmp_path / "written.ckpt")
    tensors = torch.load(tmp_path / "written.ckpt", weights_only=True)["frozen_base"]["fingerprint"]["tensors"]
    (name,) = [n for n in tensors if n.endswith("layers.0.mlp.down_proj.weight")]
    written = module.written
    assert written.dtype == torch.bfloat16 and list(written.shape) == tensors[name]["shape"]
    # the written values, not the file's: a sha256 checkpoint names what was written
    assert tensors[name]["value"] == fingerprint.tensor_sha256(written)
    weight = module.model.base_model.model.model.layers[0].mlp.down_proj.weight
    with deepspeed.zero.GatheredParameters([weight]):  # now the int8 codes of the written values, decoded
        assert torch.allclose(weight.float(), written.float(), atol=2 / 127)
