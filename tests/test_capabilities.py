"""A capability as a unit (issues 44 and 52): each optional capability's private names moved as a release would
(deleted, or under another signature), in a fresh process (``tests/scripts/names_moved.py``). A plain fit that does not
ask for the capability trains and saves; where it reaches the capability, with one warning that names the name and
what the run does instead, and where it does not, with none (a capability is looked up where it is first used). With a
name of every optional capability moved at once, a plain fit still trains, with one warning per capability it reaches.
Asked for by argument, or used by an entry point that needs it, the capability raises ``DependencyDriftError`` naming
the name; a moved core name still raises when the strategy is built, and never at ``load_adapter``, which reads none.
A plain torch model's strategy, built and fitted (its layers built in ``__init__`` or in ``configure_model``), imports
nothing of transformers, PEFT or bitsandbytes; a ``configure_model`` that imports PEFT first gets it set up as if it
had been imported before (``tests/scripts/torch_only_imports.py``).
"""

from __future__ import annotations

import json

import pytest

from lightning_frozen import capabilities
from tests.distributed import run_script
from tests.scripts.names_moved import PLAIN_FIT

# the optional capabilities a plain fit and save of a torch model reaches; the others are used only where asked for
# (`configure_model`, `generate`, a scheduler, a finetuning callback, an entry point), and are never looked up here
REACHED_BY_A_PLAIN_FIT = {
    "PREEMPTION",
    "RESUMED_EPOCH",
    "SCALER_RESUME",
    "CPU_COMPUTE",
    "RELEASE",
    "TRACE",
    "HOOKS_WHERE_PARAMS",
    "EARLY_CKPT_CHECK",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("names_moved")
    run_script("names_moved.py", str(folder / "report.json"), str(folder))
    return json.loads((folder / "report.json").read_text())


def test_every_optional_capability_is_moved_once() -> None:
    assert {getattr(capabilities, name) for name in PLAIN_FIT} == set(capabilities.OPTIONAL)


@pytest.mark.parametrize("capability", sorted(PLAIN_FIT))
def test_a_plain_fit_trains_with_one_warning_where_a_name_of_a_capability_it_does_not_use_moved(
    report: dict, capability: str
) -> None:
    found, name = report[capability], PLAIN_FIT[capability][1]
    assert found["trained"] and "layers.0.lora_a" in found["saved"]
    if capability not in REACHED_BY_A_PLAIN_FIT:
        assert found["warnings"] == []
        return
    assert len(found["warnings"]) == 1
    (warning,) = found["warnings"]
    assert f"{name}` " in warning and f"{getattr(capabilities, capability).name} is off" in warning
    assert f"so {getattr(capabilities, capability).fallback}" in warning
    # preemption's fallback is Lightning's own signal handling; with it on, Lightning's handler is never set
    assert found["lightnings_sigterm_handler"] == (capability == "PREEMPTION")


@pytest.mark.parametrize(
    ("case", "name"),
    [
        ("GENERATE asked", "PartitionedParameterCoordinator.release_and_reset_all` takes (self, args, kwargs)"),
        ("CONVERT used", "deepspeed.utils.zero_to_fp32._zero3_merge_trainable_params` is gone"),
        ("CORE", "DeepSpeedStrategy._init_optimizers` is gone"),
    ],
)
def test_a_capability_asked_for_or_used_and_the_core_raise_naming_the_name(report: dict, case: str, name: str) -> None:
    assert "moved 1 of them" in report[case] and name in report[case]


def test_load_adapter_needs_none_of_the_cores_names(report: dict) -> None:
    assert report["load_adapter, the core moved"] == ""


def test_a_plain_fit_with_every_optional_capability_off_trains_with_one_warning_per_capability_it_reaches(
    report: dict,
) -> None:
    found = report["ALL"]
    assert found["trained"]
    assert found["warnings"] == {name: int(name in REACHED_BY_A_PLAIN_FIT) for name in PLAIN_FIT}


@pytest.fixture(scope="module")
def imports(tmp_path_factory: pytest.TempPathFactory) -> dict:
    report = tmp_path_factory.mktemp("imports") / "report.json"
    run_script("torch_only_imports.py", str(report))
    return json.loads(report.read_text())


def test_a_plain_torch_models_run_imports_none_of_transformers_peft_and_bitsandbytes(imports: dict) -> None:
    # built in `__init__` and in `configure_model` (issue 63, item 5: `configure_model` imported PEFT and transformers)
    found = {key: imports[key] for key in ("imported", "built", "fitted", "configured", "watching")}
    assert found == dict(imported=[], built=[], fitted=[], configured=[], watching=[])


def test_a_configure_model_that_imports_peft_first_gets_peft_set_up_as_if_imported_before(imports: dict) -> None:
    found = imports["peft_first_imported"]
    assert found["trained"]
    assert found["seen"] == {"lora_b": [[128, True], [4, True]], "zero3": True}  # PEFT's init, whole; ZeRO-3 known
    # after the run, PEFT's and transformers' own again, and nothing left watching imports
    assert found["peft_wrapped"] == [False, False, False] and found["zero3_after"] is False
    assert found["load_state_dict"] == ["transformers.modeling_utils", "<class 'function'>"]
    assert found["watching"] == []
