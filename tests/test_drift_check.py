"""scripts/drift_check.sh (issue 39): its usage, and the summary it reads off pytest's output. The check itself
installs packages, so it runs by hand, not here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "drift_check.sh"
REPORT = ROOT / "scripts" / "drift_report.py"

_spec = importlib.util.spec_from_file_location("drift_report", REPORT)
drift_report = importlib.util.module_from_spec(_spec)
sys.modules["drift_report"] = drift_report  # the import recipe of importlib's docs: dataclasses look the module up
_spec.loader.exec_module(drift_report)

BROKEN_RUN = """\
........F...s..E..
=========================== short test summary info ============================
SKIPPED [1] tests/test_cuda.py:12: needs CUDA
FAILED tests/test_strategy.py::test_offload[nf4] - AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'x'
ERROR tests/test_resume.py::test_resume - RuntimeError: gloo timed out
FAILED tests/test_cli.py::test_help
2 failed, 13 passed, 1 skipped, 3 warnings, 1 error in 612.40s (0:10:12)
"""


def test_help_prints_the_usage_and_unknown_arguments_are_refused() -> None:
    shown = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: bash scripts/drift_check.sh")
    refused = subprocess.run(["bash", str(SCRIPT), "--nonsense"], capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown argument --nonsense" in refused.stderr


def test_the_summary_names_each_failing_test_with_its_error() -> None:
    run = drift_report.read_test_run(BROKEN_RUN)
    assert run.counts == dict(failed=2, passed=13, skipped=1, warnings=3, errors=1)
    assert run.broken == [
        "FAILED tests/test_strategy.py::test_offload[nf4] - AttributeError: 'DeepSpeedZeRoOffload' object has no"
        " attribute 'x'",
        "ERROR tests/test_resume.py::test_resume - RuntimeError: gloo timed out",
        "FAILED tests/test_cli.py::test_help",
    ]


def test_a_run_passes_only_with_no_failure_and_its_summary_line(tmp_path: Path, capsys) -> None:
    log = tmp_path / "pytest.log"
    log.write_text("....s\n=== 4 passed, 1 skipped in 3.02s ===\n")
    assert drift_report.report_tests(log) == 0
    assert capsys.readouterr().out == "tests: 4 passed, 1 skipped\n"
    log.write_text(BROKEN_RUN)
    assert drift_report.report_tests(log) == 1
    log.write_text("ImportError while loading conftest\n")  # pytest ended before counting anything
    assert drift_report.report_tests(log) == 1
    assert drift_report.main(["tests", str(log)]) == 1
    assert subprocess.run([sys.executable, str(REPORT), "--help"], capture_output=True).returncode == 0


def test_the_names_report_says_which_private_name_moved(monkeypatch, capsys) -> None:
    import dataclasses

    from lightning_frozen import capabilities
    from lightning_frozen.foreign_names import ForeignName

    gone = ForeignName("torch:nn.Module._no_such_name", used_in="zero/params.py")
    slower = ForeignName("torch:nn.Module._also_gone", used_in="zero/engine.py")
    core = dataclasses.replace(capabilities.CORE, rows=(gone, *capabilities.CORE.rows))
    release = dataclasses.replace(capabilities.RELEASE, rows=(slower, *capabilities.RELEASE.rows))
    monkeypatch.setattr(capabilities, "CORE", core)
    monkeypatch.setattr(capabilities, "OPTIONAL", (release,))
    assert drift_report.report_names() == 1
    report = capsys.readouterr().out
    assert f"private names: 2 of {len(capabilities.ROWS)} moved" in report
    assert "`torch.nn.Module._no_such_name` is gone (used in zero/params.py) [core: DependencyDriftError]" in report
    assert "[releasing a finished run's engine off: a finished run's modules stay referenced" in report
