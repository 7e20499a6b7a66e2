"""Two CPU processes under Lightning's own launcher: shard sizes, training, checkpoints moved between world sizes, and
what a plain fit prints.

Each multi-process run is a script in a subprocess (``tests/scripts/train_adapter.py``).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from tests.distributed import chained, read_reports, run_script
from tests.models import AdapterModel, cpu_trainer, regression_data

pytestmark = pytest.mark.slow  # every test here starts a 2-rank world


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """In one 2-rank world, one run after the other: one epoch (checkpoint saved), a second epoch resumed from it, two
    epochs straight, a validation from that file, and a resume of a checkpoint saved on one rank (made first)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(tmp / "one_rank.ckpt")
    runs = [
        ["--max-epochs=1", f"--save={tmp / 'one.ckpt'}", f"--report={tmp / 'one'}"],
        ["--max-epochs=2", f"--resume={tmp / 'one.ckpt'}", f"--save={tmp / 'resumed.ckpt'}", f"--report={tmp / 'r'}"],
        ["--max-epochs=2", f"--save={tmp / 'two.ckpt'}", f"--report={tmp / 'two'}"],
        [f"--validate={tmp / 'two.ckpt'}", f"--report={tmp / 'validate'}"],
        [
            "--max-epochs=1",
            f"--resume={tmp / 'one_rank.ckpt'}",
            f"--save={tmp / 'two_ranks.ckpt'}",
            f"--report={tmp / 'o'}",
        ],
    ]
    run_script("train_adapter.py", "--devices=2", *chained(*runs), timeout=600)
    names = ("one", "resumed", "two", "one_rank", "two_ranks")
    return {"dir": tmp, **{name: tmp / f"{name}.ckpt" for name in names}}


def test_each_rank_holds_a_half_shard_of_every_frozen_param(two_ranks: dict[str, Path]) -> None:
    reports = read_reports(two_ranks["dir"] / "one")
    assert [r["rank"] for r in reports] == [0, 1] and all(r["world_size"] == 2 for r in reports)
    for report in reports:
        for name, param in report["params"].items():
            assert param["grad_is_none"], name
            assert param["shard_numel"] == math.ceil(param["numel"] / 2), name
            if not param["trainable"]:
                assert param["shard_device"] == "cpu", name
    # the fp32 master partitions of the two ranks cover the 545 trainable elements (ZeRO pads each to an even count)
    trainable = [p["numel"] for p in reports[0]["params"].values() if p["trainable"]]
    assert sum(r["fp32_partition_numel"] for r in reports) == sum(2 * math.ceil(n / 2) for n in trainable)
    assert sum(trainable) == 545


def test_resume_on_two_ranks_is_exact(two_ranks: dict[str, Path]) -> None:
    straight = torch.load(two_ranks["two"], weights_only=True)
    resumed = torch.load(two_ranks["resumed"], weights_only=True)
    assert straight["global_step"] == resumed["global_step"] == 8
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value)
        torch.testing.assert_close(
            resumed["optimizer_states"][0]["state"][name]["exp_avg_sq"],
            straight["optimizer_states"][0]["state"][name]["exp_avg_sq"],
        )


def test_the_fingerprint_does_not_depend_on_the_world_size(two_ranks: dict[str, Path], tmp_path: Path) -> None:
    trainer = cpu_trainer(max_steps=1)
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(tmp_path / "single.ckpt")
    single = torch.load(tmp_path / "single.ckpt", weights_only=True)["frozen_base"]["fingerprint"]
    double = torch.load(two_ranks["one"], weights_only=True)["frozen_base"]["fingerprint"]
    assert single["digest"] == double["digest"]


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"]
    assert sorted(a["state_dict"]) == sorted(b["state_dict"])
    for name, value in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][name], value)
        for key, state in a["optimizer_states"][0]["state"][name].items():
            torch.testing.assert_close(b["optimizer_states"][0]["state"][name][key], state)


def test_saved_on_two_ranks_resumes_on_one(two_ranks: dict[str, Path], tmp_path: Path) -> None:
    # resuming at the end of the saved epoch trains no further: what is saved again must be what was loaded
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(AdapterModel(), regression_data(), ckpt_path=two_ranks["one"])
    trainer.save_checkpoint(tmp_path / "again.ckpt")
    _assert_same_state(
        torch.load(two_ranks["one"], weights_only=True), torch.load(tmp_path / "again.ckpt", weights_only=True)
    )
    # and it trains on from there on one rank
    trainer = cpu_trainer(max_epochs=2)
    trainer.fit(AdapterModel(), regression_data(), ckpt_path=two_ranks["one"])
    assert trainer.global_step == 4 + 8


def test_saved_on_one_rank_resumes_on_two(two_ranks: dict[str, Path]) -> None:
    _assert_same_state(
        torch.load(two_ranks["one_rank"], weights_only=True), torch.load(two_ranks["two_ranks"], weights_only=True)
    )


def test_validate_on_two_ranks_from_a_checkpoint(two_ranks: dict[str, Path]) -> None:
    reports = read_reports(two_ranks["dir"] / "validate")
    loaded = __import__("lightning_frozen").load_adapter(AdapterModel(), two_ranks["two"]).eval()
    x, y = next(iter(regression_data(batch_size=64)))
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(loaded(x), y).item()
    # each rank validates half of the data: the mean of the two halves' losses is the loss of the whole
    halves = [r["metrics"][0]["val_loss"] for r in reports]
    assert len(halves) == 2 and sum(halves) / 2 == pytest.approx(expected, rel=1e-4)


# what a plain fit prints that is Lightning's usual output: its rank-zero lines, its warnings, the model summary
LIGHTNING_USUAL = re.compile(
    r"^(GPU available|TPU available|💡 Tip|initializing deepspeed distributed|`Trainer\.fit` stopped|`Trainer\(limit_"
    r"|Trainable params|Non-trainable params|Total params|Total estimated model params size"
    r"|Modules in (train|eval) mode|Total FLOPs|[┏┃┡│└])|/lightning/(pytorch|fabric)/\S+\.py:\d+: "
)
# every other line, named with whose it is and why it stays, and how many of its lines each rank prints
DEPENDENCY_LINES = {
    # DeepSpeed's CPU collectives: a print of its op builder; torch 2.14's cpp_extension, which that builder imports,
    # warns where a CUDA toolkit is installed without a GPU (as on this project's machines)
    r"^DeepSpeed deepspeed\.ops\.comm\.deepspeed_shm_comm_op built successfully$": 1,
    r"torch/utils/cpp_extension\.py:\d+\] No CUDA runtime is found, using CUDA_HOME=": 1,
    # transformers' progress bar in the user's `from_pretrained` (its first and last state)
    r"^Loading weights: ": 2,
    # PEFT 0.21.2's `get_peft_model` reads a property transformers 5 deprecated: the user's call, stock Lightning too
    r"transformers/modeling_utils\.py:\d+: FutureWarning: `is_gradient_checkpointing` is deprecated"
    r"|^  warnings\.warn\(": 2,
}
# where bitsandbytes is installed (the test extra; a plain install has none), PEFT imports it, and on CPUs with
# AVX-512 BF16 it tries to download a kernel through the `kernels` package
BITSANDBYTES_LINES = {r"^Failed to load CPU gemm_4bit_forward from kernels-community|^Skipping publisher trust": 2}


def test_a_plain_two_rank_fit_prints_only_its_own_lightnings_and_named_dependency_lines(tmp_path: Path) -> None:
    result = run_script("plain_fit.py", str(tmp_path), timeout=300)

    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("lightning-frozen: ")]
    known = DEPENDENCY_LINES | (BITSANDBYTES_LINES if importlib.util.find_spec("bitsandbytes") else {})
    others = [line for line in lines if line not in own and not LIGHTNING_USUAL.search(line)]
    unnamed = [line for line in others if not any(re.search(pattern, line) for pattern in known)]

    assert unnamed == [], f"{len(lines)} lines, {len(others)} from dependencies; not named:\n" + "\n".join(unnamed)
    assert [line.split(".")[0] for line in own] == [
        "lightning-frozen: 37,634 trainable / 22,713,986 frozen params on 2 rank(s)",
        "lightning-frozen: `LoRASentimentClassifier`'s params are still ZeRO-3 shards, empty outside the Trainer (torch"
        " raises `'weight' must be 2-D` or `mat2 must be a matrix`)",
    ]
    assert len(others) <= 2 * sum(known.values()), "\n".join(others)  # each rank prints its own
