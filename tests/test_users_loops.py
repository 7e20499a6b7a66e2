"""Users' own evaluation loops under ZeRO-3: the ranks' batch counts compared (with a stand-in for the collective in
this process), and on 2 CPU ranks (scripts in subprocesses, ``tests/scripts/``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_frozen import loops
from lightning_frozen.errors import UnevenBatchesError
from tests.distributed import run_script


def _gather_from(*ranks: object):
    """A stand-in for the all-gather: this rank's value is ``ranks[0]``, the others' are given."""
    return lambda value: [value, *ranks[1:]]


def test_counts_known_on_every_rank_must_agree() -> None:
    loops.check_even_batches("val", [3, 5], _gather_from(None, [3, 5]))
    with pytest.raises(UnevenBatchesError, match=r"dataloader 1: rank 0: 5, rank 1: 4\..*DistributedSampler"):
        loops.check_even_batches("val", [3, 5], _gather_from(None, [3.0, 4.0]))
    loops.check_even_batches("test", [math.inf], _gather_from(None, [7.0]))  # unknown: agreed batch by batch instead


def test_a_loader_without_length_stops_every_rank_together() -> None:
    agreed = loops.EvenBatches([1, 2], "predict", _gather_from(None, True))
    with pytest.raises(UnevenBatchesError, match=r"predict batches: rank 0: 2, rank 1: 3 or more"):
        list(agreed)
    assert list(loops.EvenBatches([1, 2], "predict", lambda has: [has, has])) == [1, 2]
    assert not loops.has_length(agreed) and loops.has_length([1])


@pytest.fixture(scope="module")
def uneven_eval(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each rank's report of each case of ``tests/scripts/uneven_eval.py``, run once on 2 ranks."""
    report = tmp_path_factory.mktemp("uneven_eval")
    run_script("uneven_eval.py", f"--report={report}", timeout=300)
    return report


def _reports(report: Path, case: str) -> list[str]:
    return [(report / f"{case}-rank{rank}.txt").read_text() for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sized", "iterable"])
def test_uneven_validation_data_fails_on_every_rank_naming_the_counts(case: str, uneven_eval: Path) -> None:
    # without the check, rank 1 returns and rank 0 dies in its third batch with gloo's "Connection closed by peer"
    counts = "rank 0: 3, rank 1: 2" if case == "sized" else "rank 0: 3 or more, rank 1: 2"
    for report in _reports(uneven_eval, case):
        assert "different numbers of val batches" in report and counts in report, report
        assert "DistributedSampler" in report, report


@pytest.mark.slow
def test_even_validation_data_without_a_length_validates(uneven_eval: Path) -> None:
    first, second = _reports(uneven_eval, "even")
    assert first.startswith("ok ") and first == second, (first, second)


@pytest.mark.slow
def test_generate_in_validation_stays_in_step_and_uses_the_adapter(tmp_path: Path) -> None:
    # without `synced_gpus` made the default for the run, rank 0 stops after 3 tokens and rank 1 waits forever in
    # the gather of its 4th: the script runs past its time limit
    import json

    import lightning_frozen
    from tests.pretrained_support import write_llama
    from tests.scripts.generate_in_validation import NEW_TOKENS, GeneratingLoRA

    folder = write_llama(tmp_path / "llama")
    run_script("generate_in_validation.py", f"--folder={folder}", f"--report={tmp_path}", timeout=300)
    # the folder is bf16 and `from_pretrained` keeps it so; the run computed in fp32 (`32-true`), as here
    loaded = lightning_frozen.load_from_checkpoint(GeneratingLoRA, tmp_path / "adapter.ckpt").float()
    for rank, new in NEW_TOKENS.items():
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        prompts = torch.tensor(seen["prompts"])
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert loaded.model.generate(input_ids=prompts, **options).tolist() == seen["ids"], rank
        assert len(seen["ids"][0]) == prompts.shape[1] + new
        assert seen["ids"] != seen["base_ids"], "the adapter changed nothing the test could see"
