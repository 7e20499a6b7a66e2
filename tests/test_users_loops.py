"""Users' own evaluation loops under ZeRO-3 on 2 CPU ranks (scripts in subprocesses, ``tests/scripts/``): data that
runs out on some ranks is joined or refused (tests/test_uneven.py), ``generate`` stays in step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.causal_lm_lora.make_base import write_random_llama
from tests.distributed import run_script
from tests.pretrained_support import TINY_LLAMA


def test_the_models_whose_generate_a_run_wraps_are_the_outermost_transformers_models() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_frozen.hf.generation import generating_models

    student = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), LoraConfig(r=2, target_modules=["q_proj"]))
    teacher = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    module = torch.nn.ModuleDict({"student": student, "teacher": teacher})
    # the PEFT model's base (its generate calls the base's), and the teacher beside it: each gathered on its own
    assert generating_models(module) == [student.base_model.model, teacher]
    assert generating_models(torch.nn.Linear(2, 2)) == []


@pytest.fixture(scope="module")
def uneven_eval(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each rank's report of each case of ``tests/scripts/uneven_eval.py``, run once on 2 ranks."""
    report = tmp_path_factory.mktemp("uneven_eval")
    run_script("uneven_eval.py", f"--report={report}", timeout=300)
    return report


def _reports(report: Path, case: str) -> list[str]:
    return [(report / f"{case}-rank{rank}.txt").read_text() for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sized-refused", "refused"])
def test_refused_uneven_validation_data_fails_on_every_rank_naming_the_counts(case: str, uneven_eval: Path) -> None:
    # unrefused, rank 1 would return and rank 0 die in its third batch with gloo's "Connection closed by peer";
    # lengths known differ before the first batch, and a stream is refused where it runs out
    counts = "rank 0: 3, rank 1: 2" if case == "sized-refused" else "rank 0: 3 or more, rank 1: 2"
    for report in _reports(uneven_eval, case):
        assert "different numbers of val batches" in report and counts in report, report
        assert "DistributedSampler" in report, report


@pytest.mark.slow
@pytest.mark.parametrize("case", ["iterable", "sized"])
def test_data_that_runs_out_on_one_rank_validates_as_one_process_over_all_the_data(
    case: str, uneven_eval: Path
) -> None:
    from tests.models import AdapterModel
    from tests.scripts.uneven_eval import BATCH, SAMPLES

    # rank 0's three batches and rank 1's two, the first ones of SAMPLES on each, in one process
    model = AdapterModel()
    with torch.no_grad():
        losses = [
            torch.nn.functional.mse_loss(model(SAMPLES[start : start + BATCH]), SAMPLES[start : start + BATCH, :1])
            for start in [0, BATCH, 2 * BATCH, 0, BATCH]
        ]
    first, second = _reports(uneven_eval, case)
    assert first == second and first.startswith("ok "), (first, second)
    assert float(first.split()[1]) == pytest.approx(torch.stack(losses).mean().item(), abs=2e-6)


@pytest.mark.slow
def test_generate_in_validation_stays_in_step_and_uses_the_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without `synced_gpus` made the default for the run, rank 0 stops after 3 tokens and rank 1 waits forever in
    # the gather of its 4th: the script runs past its time limit
    import json

    import lightning_frozen
    from tests.pretrained_support import write_llama
    from tests.scripts.generate_in_validation import NEW_TOKENS, GeneratingLoRA

    folder = write_llama(tmp_path / "llama")
    teacher_folder = tmp_path / "teacher"
    write_random_llama(teacher_folder, TINY_LLAMA, torch.bfloat16, seed=7)
    result = run_script(
        "generate_in_validation.py",
        f"--folder={folder}",
        f"--report={tmp_path}",
        f"--teacher={teacher_folder}",
        timeout=300,
    )
    # the default budget (half the free memory) holds the tiny student: its base was gathered once per call
    assert "generate() gathers the frozen base once per call" in result.stderr, result.stderr[-3000:]
    # the folder is bf16 and `from_pretrained` keeps it so; the run computed in fp32 (`32-true`), as here. The
    # checkpoint names both frozen folders, so the module is built as in the run: with its teacher
    monkeypatch.setattr(GeneratingLoRA, "teacher_folder", str(teacher_folder))
    loaded = lightning_frozen.load_from_checkpoint(GeneratingLoRA, tmp_path / "adapter.ckpt").float()
    for rank, new in NEW_TOKENS.items():
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        prompts = torch.tensor(seen["prompts"])
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert loaded.model.generate(input_ids=prompts, **options).tolist() == seen["ids"], rank
        assert len(seen["ids"][0]) == prompts.shape[1] + new
        assert seen["ids"] != seen["base_ids"], "the adapter changed nothing the test could see"
        _check_reference_and_teacher(seen["steps"], folder, teacher_folder)

    # the checkpoint holds the student's adapter only: nothing of the frozen teacher
    saved = torch.load(tmp_path / "adapter.ckpt", weights_only=True)["state_dict"]
    assert saved and not [key for key in saved if key.startswith("teacher.")]


def _check_reference_and_teacher(steps: list[dict[str, Any]], base_folder: Path, teacher_folder: Path) -> None:
    """At every step of the run, the reference (the adapter disabled) equals the base in one plain process, and the
    teacher equals its folder's model: neither moved, neither is the other."""
    from transformers import AutoModelForCausalLM

    assert len(steps) == 4  # one batch a rank for each of the 4 epochs
    base = AutoModelForCausalLM.from_pretrained(base_folder).float().eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_folder).float().eval()
    for step in steps:
        ids = torch.tensor(step["ids"])
        with torch.no_grad():
            for model, seen in ((base, step["reference"]), (teacher, step["teacher"])):
                torch.testing.assert_close(torch.tensor(seen), model(input_ids=ids).logits[:, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_generate_gathers_the_base_once_per_call_within_the_budget_and_per_layer_beyond(tmp_path: Path) -> None:
    # `trainer.validate` on 2 ranks, with a random adapter: each rank generates 3 and then 9 new tokens, counting the
    # ZeRO-3 all-gathers each call starts. Within the budget the count is the same for both (once per call); with a
    # budget of 1 byte it grows with the tokens (each forward gathers every layer), and the ids are the same. For the
    # base as the folder stores it and as nf4
    import json

    from tests.pretrained_support import write_llama
    from tests.scripts.generate_in_validation import NEW_TOKENS, GeneratingLoRA, build_with_random_adapter

    folder = write_llama(tmp_path / "llama")
    arguments = (f"--folder={folder}", f"--report={tmp_path}", "--generation-memory=1GB,1", "--frozen-dtype=none,nf4")
    # one launch, a `validate` per frozen dtype and budget: the budget of 1 GB, then of 1 byte, for each dtype
    log = run_script("generate_in_validation.py", *arguments, "--count-gathers", "--validate-only", timeout=300).stderr
    notices = log.split("lightning-frozen: generate() gathers")[1:]  # one notice a run, on rank 0
    assert len(notices) == 4, len(notices)
    for frozen_dtype, (once, per_layer) in zip(("none", "nf4"), (notices[:2], notices[2:])):
        reports = {
            budget: [
                json.loads((tmp_path / f"{frozen_dtype}-budget-{budget}" / f"rank{rank}.json").read_text())
                for rank in range(2)
            ]
            for budget in ("1GB", "1")
        }
        assert once.startswith(" the frozen base once per call: the model is"), once[:300]
        assert "within `generation_memory` (953.67 MiB)" in once.splitlines()[0]
        assert per_layer.startswith(" the frozen base layer by layer: the model is"), per_layer[:300]
        assert "over `generation_memory` (1 B); raise it" in per_layer.splitlines()[0]

        for rank in range(2):
            gathered_once, layer_by_layer = reports["1GB"][rank], reports["1"][rank]
            short, long = (call["gathers"] for call in gathered_once["counted"])
            assert short == long > 0, gathered_once["counted"]
            short, long = (call["gathers"] for call in layer_by_layer["counted"])
            assert long > short > 0, layer_by_layer["counted"]
            for key in ("ids", "base_ids"):
                assert gathered_once[key] == layer_by_layer[key], (frozen_dtype, rank, key)
            assert [c["ids"] for c in gathered_once["counted"]] == [c["ids"] for c in layer_by_layer["counted"]]
            assert gathered_once["ids"] != gathered_once["base_ids"], "the adapter changed nothing the test could see"

        if frozen_dtype == "none":  # the same weights in one plain process (nf4 stores other values than the folder's)
            plain = GeneratingLoRA(str(folder))
            build_with_random_adapter(plain)
            for rank, new in NEW_TOKENS.items():
                seen = reports["1GB"][rank]
                options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
                with torch.no_grad():
                    ids = plain.model.generate(input_ids=torch.tensor(seen["prompts"]), **options).tolist()
                assert ids == seen["ids"], rank


@pytest.mark.slow
def test_a_scorer_loaded_in_setup_is_the_folders_model_whole_beside_a_sharded_base(tmp_path: Path) -> None:
    # before, transformers believed ZeRO-3 was on for the whole run: the scorer's `from_pretrained` in `setup()` went
    # under `zero.Init` and failed on 2 ranks ("Either train_batch_size or train_micro_batch_size_per_gpu ...")
    import json

    from transformers import AutoModelForCausalLM

    from tests.pretrained_support import write_llama

    folder = write_llama(tmp_path / "llama")
    run_script("scorer_in_setup.py", f"--folder={folder}", f"--report={tmp_path}", "--frozen-dtypes=none,nf4")
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(report) == ["nf4", "none"], sorted(report)
        for frozen_dtype, run in report.items():
            assert run["zero_params"] == [], (frozen_dtype, run["zero_params"])
            scorer = torch.load(tmp_path / f"scorer-{frozen_dtype}-rank{rank}.pt", weights_only=True)
            assert scorer.keys() == plain.state_dict().keys()
            for name, value in plain.state_dict().items():
                assert torch.equal(scorer[name], value), (frozen_dtype, rank, name)
            assert len(run["scored"]) == 4  # a rank's 2 steps (an epoch each), each epoch then validating 1 batch
            with torch.no_grad():
                for seen in run["scored"]:
                    expected = plain(input_ids=torch.tensor(seen["ids"])).logits[:, -1]
                    torch.testing.assert_close(torch.tensor(seen["scores"]), expected.float())
            # the base built in `configure_model` is sharded as before, and read as slices (nf4: encoded as read)
            base = run["configure_model_base"]
            frozen = [shard for shard in base["shards"].values() if not shard["trainable"]]
            assert frozen and all(shard["shard_numel"] < shard["numel"] for shard in frozen if shard["numel"] > 1)
            if frozen_dtype == "none":
                assert all(base["frozen_equal"].values()), base["frozen_equal"]
            else:
                assert {shard["dtype"] for shard in frozen} == {"uint8"} and base["quantized_at_load"] > 0
