"""Ranks that run out of data keep serving the others (docs/loops.md): the step's agreement and weights in this
process, and 2-rank fits from an uneven ``IterableDataset`` whose weights equal plain torch's over the real batches,
stopped by SIGTERM in a stand-in's step and resumed (``tests/scripts/uneven_train.py``)."""

from __future__ import annotations

import math
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_frozen import loops
from lightning_frozen.checkpoint.file import read_checkpoint
from lightning_frozen.errors import UnevenBatchesError
from tests.distributed import launch, read_reports, run_script

SIGTERM_STATUS = 128 + signal.SIGTERM


def _gather_from(*others: Any):
    """A stand-in for the all-gather on rank 0 of ``1 + len(others)`` ranks: the others' values are given."""
    return lambda value: [value, *others]


class _Logging:
    def log(self, name: str, value: Any, *, batch_size: Any = None) -> None:
        """A LightningModule's ``log``, which :meth:`loops.Joining.step` replaces on a stand-in's step."""


def test_a_rank_that_ran_out_yields_stand_ins_weighed_zero_until_every_rank_has() -> None:
    joining = loops.Joining()
    # rank 0 has 2 batches, rank 1 (given) 3: rank 0 runs the third step on its last batch
    flags = iter([(True, False), (True, False), (True, False), (False, False)])
    agreed = loops.AgreedBatches(["a", "b"], "train", joining, rank=0, gather=lambda value: [value, next(flags)])
    assert list(agreed) == ["a", "b", "b"]
    weights, module = [], _Logging()
    for _ in range(3):
        with joining.step("train", module):
            weights.append(joining.weighed(torch.tensor(1.0)).item())
            assert ("log" in vars(module)) == (len(weights) == 3)  # weightless on the stand-in's step only
    assert "log" not in vars(module)
    assert weights == [1.0, 1.0, 0.0]  # every rank had a batch: the loss as it is; then a stand-in's counts nothing
    with joining.step("train", _Logging()) as share:
        assert share is None  # nothing fetched: an unwrapped loader's step


def test_the_ranks_with_data_average_over_the_real_batches_and_a_rank_with_none_borrows_one() -> None:
    joining = loops.Joining()
    sent = []

    # rank 0 of 4: ranks 1 and 2 have data too (rank 2 had some before), rank 3 has never had any
    answers = iter([[(True, False), (True, False), (False, False), (False, True)], ["x", None, None, None]])

    def gather(value: Any) -> list[Any]:
        sent.append(value)
        return next(answers)

    agreed = loops.AgreedBatches(["x"], "train", joining, rank=0, gather=gather)
    assert next(iter(agreed)) == "x"
    with joining.step("train", _Logging()) as share:
        assert share == loops.Share(real=2, world=4, joined=False)  # 2 real batches: rank 0's and rank 1's
        assert joining.weighed(torch.tensor(3.0)).item() == 6.0  # x 4/2: ZeRO's mean over 4 is the mean over 2
    assert sent[1] == "x"  # rank 0, the first with data, sends its batch to the rank that had none


def test_refused_uneven_data_raises_on_every_rank_with_the_counts() -> None:
    agreed = loops.AgreedBatches([1, 2], "predict", loops.Joining(refuse=True), 0, _gather_from((True, False)))
    with pytest.raises(UnevenBatchesError, match=r"predict batches: rank 0: 2, rank 1: 3 or more"):
        list(agreed)
    assert loops.length(agreed) is None and loops.length([1]) == 1


def _trainer(stage: str = "train") -> Any:
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import RunningStage

    return SimpleNamespace(state=SimpleNamespace(stage=RunningStage(stage)), global_rank=0)


def test_lengths_that_differ_are_agreed_once_and_the_loader_is_as_long_as_the_longest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    joining, gathers = loops.Joining(), []

    def gather(value: Any) -> list[Any]:
        gathers.append(value)
        return [value, 3, 0, 1]  # ranks 1 to 3 of 4: 3 batches, none, 1

    with caplog.at_level("INFO"):
        agreed = loops.even_dataloader(["a", "b"], _trainer(), 4, joining, gather)
        assert len(agreed) == 3 and list(agreed) == ["a", "b", "b"]
    # the lengths once, then rank 2's first batch from rank 0, the first with one; nothing agreed per batch
    assert gathers == [2, "a"]
    shares = []
    for _ in range(3):
        with joining.step("train", _Logging()) as share:
            shares.append(share)
    assert shares == [loops.Share(3, 4, False), loops.Share(2, 4, False), loops.Share(1, 4, True)]
    told = [record.getMessage() for record in caplog.records]
    assert len(told) == 1, told  # once, with each rank's whole count
    assert "rank 2 ran out of train batches (rank 0: 2, rank 1: 3, rank 2: 0, rank 3: 1)" in told[0], told


def test_even_lengths_leave_the_loader_as_it_is_and_refused_uneven_ones_raise_before_the_first_batch() -> None:
    loader = [1, 2]
    assert loops.even_dataloader(loader, _trainer("validate"), 2, loops.Joining(), _gather_from(2)) is loader
    with pytest.raises(UnevenBatchesError, match=r"val batches: rank 0: 2, rank 1: 3\. Under ZeRO-3"):
        loops.even_dataloader(loader, _trainer("validate"), 2, loops.Joining(refuse=True), _gather_from(3))
    assert loops.even_dataloader(loader, _trainer(), 1, loops.Joining(), _gather_from()) is loader


def test_the_summary_at_the_start_says_what_uneven_data_meets_on_several_ranks() -> None:
    assert loops.Joining().summary(2).startswith(" Uneven batches: join (a rank that runs out of batches")
    assert loops.Joining(refuse=True).summary(4).startswith(" Uneven batches: raise (every rank raises")
    assert loops.Joining().summary(1) == ""


def test_a_stand_ins_logged_values_count_for_nothing_in_epoch_means_and_sums() -> None:
    logged = []

    def log(name: str, value: Any, prog_bar: bool = False, *, reduce_fx: Any = "mean", batch_size: Any = None) -> None:
        logged.append((name, float(value), reduce_fx, batch_size))

    weightless = loops.weightless(log)
    weightless("loss", torch.tensor(2.0))
    weightless("seen", 4.0, reduce_fx="sum")
    weightless("peak", 5.0, reduce_fx="max")
    assert logged == [("loss", 2.0, "mean", 0), ("seen", 0.0, "sum", None), ("peak", 5.0, "max", None)]


def test_uneven_batches_takes_join_or_raise() -> None:
    from lightning_frozen import FrozenAwareDeepSpeedStrategy
    from lightning_frozen.errors import InvalidArgumentValueError

    assert FrozenAwareDeepSpeedStrategy().spec.uneven_batches == "join"
    assert FrozenAwareDeepSpeedStrategy(uneven_batches="raise").spec.uneven_batches == "raise"
    with pytest.raises(InvalidArgumentValueError, match=r"`uneven_batches='drop'` is not one of \('join', 'raise'\)"):
        FrozenAwareDeepSpeedStrategy(uneven_batches="drop")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def uneven_train(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each case's reports of ``tests/scripts/uneven_train.py``, run on 2 ranks: its cases up to the SIGTERM, which
    ends the launch, then the resume from the checkpoint it left (today: the first fit hangs)."""
    from tests.peft_models import save_tiny_llama

    report = tmp_path_factory.mktemp("uneven_train")
    llama = f"--llama={save_tiny_llama(report / 'llama')}"
    run_script("uneven_train.py", f"--report={report}", llama, timeout=400, status=SIGTERM_STATUS)
    run_script("uneven_train.py", f"--report={report}", "--cases=resume", timeout=240)
    return report


@pytest.fixture(scope="module")
def uneven_four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reports of ``tests/scripts/uneven_train.py``'s 4-rank cases, in one launch."""
    report = tmp_path_factory.mktemp("uneven_four")
    run_script("uneven_train.py", f"--report={report}", "--cases=four,four-sized", timeout=400)
    return report


@pytest.fixture(scope="module")
def uneven_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``nodes`` case's reports: ``3-1`` on 2 simulated nodes of one rank each, a process per node."""
    report = tmp_path_factory.mktemp("uneven_nodes")
    args = (f"--report={report}", "--cases=nodes", "--num-nodes=2")
    codes, output, _ = launch("uneven_train.py", *args, nodes=2, timeout=240)
    assert codes == [0, 0], "\n".join(text[-4000:] for text in output)
    return report


def plain_torch(
    case: str,
    mean_over_world: bool = False,
    steps: Sequence[int] = (),
    frozen: Optional[dict[str, torch.Tensor]] = None,
    llama: Optional[Path] = None,
    accumulate: int = 1,
    pooled: bool = False,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The trainable params after SGD steps (``steps``: which of the epoch's, in order; else all) whose gradient is the
    mean over the real batches of each step (or, with ``mean_over_world``, the sum over the ranks: what ZeRO's average
    gives a stand-in not weighed 0), and each real batch's loss before its step. ``frozen``: the frozen weights the
    run computed with; ``llama``: the ``adapters`` case's base. With ``accumulate``, an optimizer step every
    ``accumulate`` steps (micro-steps), whose gradient is the mean over its micro-steps of each one's mean over its real
    batches, divided by ``accumulate`` once more (Lightning divides the loss by it, and DeepSpeed's ``backward`` again);
    with ``pooled``, instead the mean over all the real batches of its micro-steps, and nothing more."""
    from tests.scripts.uneven_train import CASES, LR, SGDAdapter, SGDAdapters, batches_of

    model = SGDAdapters(str(llama)) if case == "adapters" else SGDAdapter()
    if frozen:
        model.load_state_dict(frozen, strict=False)
    ranks = [batches_of(case, rank) for rank in range(len(CASES[case]))]
    order, losses = list(steps or range(max(CASES[case]))), []
    for first in range(0, len(order), accumulate):
        micro_steps = [
            [batches[step] for batches in ranks if step < len(batches)] for step in order[first:][:accumulate]
        ]
        for real in micro_steps:
            for x, y in real:
                if case == "adapters":
                    loss = sum(model._losses((x, y)).values())  # each adapter's mean over its rows, summed
                else:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                losses.append(loss.item())
                if pooled:
                    loss.div(sum(map(len, micro_steps))).backward()
                else:
                    loss.div((len(ranks) if mean_over_world else len(real)) * accumulate**2).backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param -= LR * param.grad
                    param.grad = None
    return {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}, losses


@pytest.mark.slow
@pytest.mark.parametrize("case", ["3-1", "3-0", "sized", "nodes"])
def test_uneven_streams_train_an_epoch_as_the_real_batches_on_as_many_ranks(
    case: str, request: pytest.FixtureRequest
) -> None:
    # `nodes`: `3-1`'s batches on 2 simulated nodes of one process each, against `3-1`'s reference
    reports = read_reports(request.getfixturevalue("uneven_nodes" if case == "nodes" else "uneven_train") / case)
    assert len(reports) == 2
    expected, losses = plain_torch("3-1" if case == "nodes" else case)
    world_mean, _ = plain_torch("3-1" if case == "nodes" else case, mean_over_world=True)
    assert any(not torch.allclose(expected[name], world_mean[name], atol=1e-5) for name in expected)  # it can fail
    for report in reports:
        assert report["global_step"] == 3  # a step where some rank has data is a step for every rank
        assert sorted(report["params"]) == sorted(expected)
        for name, values in report["params"].items():
            torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6)
        # the epoch's logged values count the real batches only: their samples, and the mean of their losses
        assert report["metrics"]["samples"] == 4 * len(losses)
        assert report["metrics"]["train_mean"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    said = reports[0]["said"]
    counts = {
        "3-1": "rank 0: 2 or more, rank 1: 1",
        "3-0": "rank 0: 1 or more, rank 1: 0",
        "sized": "rank 0: 3, rank 1: 1",
        "nodes": "rank 0: 2 or more, rank 1: 1",
    }
    assert said.count("ran out of train batches") == 1, said
    assert f"rank 1 ran out of train batches ({counts[case]})" in said, said
    assert said.count("lightning-frozen: 545 trainable") == said.count("Uneven batches: join (") == 1, said


@pytest.mark.slow
@pytest.mark.parametrize("case", ["four", "four-sized"])
def test_four_ranks_one_without_any_batch_train_an_epoch_as_the_real_batches(case: str, uneven_four: Path) -> None:
    # ranks of 1, 0, 3 and 2 batches: 3 real batches in the first step, 2, then 1; rank 1 serves on rank 0's first
    reports = read_reports(uneven_four / case)
    assert len(reports) == 4
    expected, losses = plain_torch(case)
    world_mean, _ = plain_torch(case, mean_over_world=True)
    assert any(not torch.allclose(expected[name], world_mean[name], atol=1e-5) for name in expected)  # it can fail
    for report in reports:
        assert report["global_step"] == 3
        assert sorted(report["params"]) == sorted(expected)
        for name, values in report["params"].items():
            torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6)
        assert report["metrics"]["samples"] == 4 * len(losses) == 4 * 6
        assert report["metrics"]["train_mean"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    counts = "rank 0: 1, rank 1: 0, rank 2: 3, rank 3: 2" if case == "four-sized" else "rank 0: 1 or more, rank 1: 0"
    assert f"rank 1 ran out of train batches ({counts}" in reports[0]["said"], reports[0]["said"]


@pytest.mark.slow
def test_accumulated_micro_steps_over_an_uneven_stream_step_as_their_real_batches_weigh(uneven_train: Path) -> None:
    # ranks of 4 batches and 1, `accumulate_grad_batches=2`: 2 optimizer steps, of micro-steps with 2 real batches
    # and 1, then 1 and 1 (rank 1 on stand-ins). Each micro-step weighs its real losses world/real and a stand-in's 0
    # (`loops.Share`), so an optimizer step's gradient is the mean over its micro-steps of their means over their real
    # batches: (g00 + g10) / 4 + g01 / 2 in the first step, not the mean over its 3 real batches (g00 + g10 + g01) / 3;
    # and halved once more, stock too: Lightning divides the loss by 2 and DeepSpeed's `engine.backward` again
    reports = read_reports(uneven_train / "accumulate")
    assert len(reports) == 2
    expected, losses = plain_torch("accumulate", accumulate=2)
    pooled, _ = plain_torch("accumulate", accumulate=2, pooled=True)  # the reading: differs
    world_mean, _ = plain_torch("accumulate", accumulate=2, mean_over_world=True)  # stand-ins not weighed 0
    for other in (pooled, world_mean):
        assert any(not torch.allclose(expected[name], other[name], atol=1e-5) for name in expected)  # it can fail
    for report in reports:
        assert report["global_step"] == 2  # optimizer steps, not micro-steps nor the stand-ins'
        assert sorted(report["params"]) == sorted(expected)
        for name, values in report["params"].items():
            torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6)
        assert report["metrics"]["samples"] == 4 * len(losses) == 4 * 5
        assert report["metrics"]["train_mean"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def decoded_frozen_weights(frozen_dtype: str, world_size: int = 2) -> dict[str, torch.Tensor]:
    """The frozen weights of ``SGDAdapter`` as a run over a base stored as ``frozen_dtype`` computes with: each rank's
    ZeRO-3 shard encoded on its own, decoded (as tests/test_quant.py's ``_expected_weight``)."""
    from lightning_frozen.format import codec
    from tests.scripts.uneven_train import SGDAdapter

    decoded = {}
    for name, param in SGDAdapter().named_parameters():
        if not param.requires_grad:
            flat, shard = param.detach().reshape(-1), math.ceil(param.numel() / world_size)
            pieces = [flat[rank * shard : (rank + 1) * shard] for rank in range(world_size)]
            pieces = [
                codec.decode(codec.encode(piece, frozen_dtype, numel=shard), shard, frozen_dtype) for piece in pieces
            ]
            decoded[name] = torch.cat(pieces)[: param.numel()].view_as(param)
    return decoded


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nf4", "int8", "adapters"])
def test_uneven_streams_train_over_a_quantized_base_and_several_adapters_as_the_real_batches(
    case: str, uneven_train: Path
) -> None:
    reports = read_reports(uneven_train / case)
    assert len(reports) == 2
    frozen = None if case == "adapters" else decoded_frozen_weights(case)
    expected, _ = plain_torch(case, frozen=frozen, llama=uneven_train / "llama")
    world_mean, _ = plain_torch(case, mean_over_world=True, frozen=frozen, llama=uneven_train / "llama")
    assert any(not torch.allclose(expected[name], world_mean[name], atol=1e-5) for name in expected)  # it can fail
    if case != "adapters":  # the codes' decoded weights are not the fp32 ones: a run over those would differ
        unquantized, _ = plain_torch(case)
        assert any(not torch.allclose(expected[name], unquantized[name], atol=1e-5) for name in expected)
    for report in reports:
        assert report["global_step"] == 3
        assert sorted(report["params"]) == sorted(expected)
        for name, values in report["params"].items():
            torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_sigterm_on_a_rank_in_its_stand_ins_step_stops_every_rank_at_that_step(uneven_train: Path) -> None:
    # rank 1 ran out after step 0 and got SIGTERM in its stand-in's step 1: both ranks stop after it and save
    reports = read_reports(uneven_train / "preempt")
    assert [(report["status"], report["global_step"]) for report in reports] == [(SIGTERM_STATUS, 2)] * 2
    assert read_checkpoint(uneven_train / "last.ckpt")["global_step"] == 2


@pytest.mark.slow
def test_a_fit_resumed_from_a_step_where_a_rank_was_joined_trains_on(uneven_train: Path) -> None:
    # a stream without a state of its own starts again from its first batch (Lightning's resume of an IterableDataset):
    # the two steps before the stop, then the epoch's three, each averaged over its real batches
    reports = read_reports(uneven_train / "resume")
    expected, _ = plain_torch("resume", steps=[0, 1, 0, 1, 2])
    assert [report["global_step"] for report in reports] == [5, 5]
    for report in reports:
        for name, values in report["params"].items():
            torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_predict_on_an_uneven_stream_gives_each_ranks_real_batches_and_none_for_its_stand_ins(
    uneven_train: Path,
) -> None:
    from tests.scripts.uneven_train import SGDAdapter, batches_of

    model = SGDAdapter()
    first, second = read_reports(uneven_train / "predict")
    with torch.no_grad():
        expected = [[model(x) for x, _ in batches_of("predict", rank)] for rank in range(2)]
    assert len(first["predicted"]) == 3 and second["predicted"][1:] == [None, None]
    for found, wanted in zip(first["predicted"] + second["predicted"][:1], expected[0] + expected[1]):
        torch.testing.assert_close(torch.tensor(found), wanted, rtol=1e-5, atol=1e-6)
