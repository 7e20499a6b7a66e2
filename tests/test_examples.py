"""Each example's ``run.py``, run as a user runs it (a subprocess from the repository root), cut short."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from lightning_frozen.cli import main
from tests.cli_support import command_env

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.enable_progress_bar=false"]


def _run_example(name: str, out: Path, *overrides: str) -> str:
    """Run ``examples/<name>/run.py --out <out> <overrides>``; return its output, failing with it if it fails."""
    result = subprocess.run(
        [sys.executable, f"examples/{name}/run.py", "--out", str(out), *overrides],
        cwd=REPO,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def _checkpoint(out: Path) -> Path:
    (path,) = out.glob("lightning_logs/version_0/checkpoints/*.ckpt")
    return path


def test_the_main_jobs_processes_find_no_bitsandbytes_and_the_tests_do() -> None:
    """PEFT imports bitsandbytes wherever it is installed, and on CPUs with AVX-512 BF16 that import logs "Failed to
    load CPU gemm_4bit_forward": the set-up keeps it out of the venv the README's main job runs in, beside it for us."""
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('bitsandbytes'))"],
        cwd=REPO,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.stdout.strip() == "None", f"bitsandbytes is in {sys.prefix}: run `bash scripts/bootstrap.sh` again"
    assert importlib.util.find_spec("bitsandbytes") is not None, "tests/conftest.py found no bitsandbytes"


@pytest.mark.slow
def test_minilm_lora_trains_exports_to_peft_and_reloads_to_the_same_logits(tmp_path: Path) -> None:
    output = _run_example("minilm_lora", tmp_path, *SHORT, "--trainer.limit_val_batches=2")

    assert "Failed to load" not in output
    assert "lightning-frozen: 37,634 trainable / 22,713,986 frozen params on 1 rank(s)" in output
    assert re.search(r"frozen base: +22,713,986 params +86\.65 MiB", output)
    assert re.search(r"adapter checkpoint: +37,634 params", output)
    difference = float(re.search(r"max \|logit difference\| between the two reloads: (\S+)", output).group(1))
    assert difference <= 1e-4
    saved = torch.load(_checkpoint(tmp_path), weights_only=True)
    assert len(saved["state_dict"]) == 26  # 6 layers x (query, value) x (A, B) + the head's weight and bias
    assert sum(t.numel() for t in saved["state_dict"].values()) == 37_634
    config = json.loads((tmp_path / "peft_adapter" / "adapter_config.json").read_text())
    assert (config["r"], sorted(config["target_modules"])) == (4, ["query", "value"])
    assert (tmp_path / "peft_adapter" / "adapter_model.safetensors").stat().st_size > 36_864 * 4


@pytest.mark.slow
def test_lr_zero_workaround_is_converted_and_the_backbone_left_out(tmp_path: Path) -> None:
    output = _run_example("lr_zero_workaround", tmp_path, *SHORT, "--trainer.limit_val_batches=2")

    assert "backbone: 103 of 103 tensors require grad" in output
    assert "froze 103 parameter tensors (22,713,216 elements) whose learning rate is 0" in output
    assert "backbone after fit: 0 of 103 tensors require grad" in output
    saved = torch.load(_checkpoint(tmp_path), weights_only=True)
    assert sorted(saved["state_dict"]) == ["head.bias", "head.weight"]
    assert sorted(saved["optimizer_states"][0]["state"]) == ["head.bias", "head.weight"]
    assert "verified the frozen base: the backbone is unchanged" in output


@pytest.mark.slow
def test_two_process_run_shards_the_base_and_reloads_in_one_process(tmp_path: Path) -> None:
    output = _run_example("two_process", tmp_path, *SHORT)

    assert "lightning-frozen: 37,634 trainable / 22,713,986 frozen params on 2 rank(s)" in output
    assert "frozen shards 43.32 MiB (fp32) in cpu memory" in output
    assert "written by 2 ranks" in output
    one_process, two_ranks = map(
        float, re.search(r"accuracy: (\S+) in one process, (\S+) on two ranks", output).groups()
    )
    assert abs(one_process - two_ranks) <= 2 / 80  # same 80 sentences; a borderline logit may round either way


@pytest.mark.slow
def test_causal_lm_lora_loads_in_configure_model_on_two_ranks_and_both_reloads_generate_alike(tmp_path: Path) -> None:
    output = _run_example("causal_lm_lora", tmp_path, *SHORT, "--trainer.limit_val_batches=2")

    assert (tmp_path / "base" / "model.safetensors").is_file()
    assert "loaded " + str(tmp_path / "base") + " into ZeRO-3 shards: 39 tensors, 6.3 of 6.3 MiB (100%)" in output
    assert "lightning-frozen: 156,160 trainable / 3,295,488 frozen params on 2 rank(s)" in output
    assert "frozen shards 3.14 MiB (bf16) in a mapped file (" in output  # the code cache's, written by this fit
    assert "max |logit difference| between the two reloads: 0.00e+00" in output
    base_loss, adapter_loss = map(float, re.search(r"validation loss: base (\S+), adapter (\S+)", output).groups())
    assert adapter_loss < base_loss
    generated = re.search(r"adapter generates: +(\[[\d, ]+\]) \(both reloads\)", output).group(1)
    assert len(json.loads(generated)) == 8
    saved = torch.load(_checkpoint(tmp_path), weights_only=True)
    assert len(saved["state_dict"]) == 4 * 7 * 2  # 4 layers x 7 projections x (A, B)
    assert sum(t.numel() for t in saved["state_dict"].values()) == 156_160
    assert saved["frozen_base"]["reference"] == str(tmp_path / "base")
    config = json.loads((tmp_path / "peft_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["task_type"], len(config["target_modules"])) == (8, "CAUSAL_LM", 7)


def test_the_main_config_takes_strategy_options_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    config = REPO / "examples" / "minilm_lora" / "config.yaml"

    with pytest.raises(SystemExit), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        main(["fit", "--config", str(config), "--trainer.strategy.init_args.offload_frozen=false", "--print_config"])

    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["init_args"]["offload_frozen"] is False
    assert printed["model"]["class_path"] == "examples.minilm_lora.task.LoRASentimentClassifier"


@pytest.mark.slow
def test_adapter_sweep_trains_three_adapters_at_once_and_exports_the_best_alone(tmp_path: Path) -> None:
    output = _run_example("adapter_sweep", tmp_path, *SHORT, "--trainer.limit_val_batches=2")

    names = ["r4_lr1e-3", "r4_lr3e-3", "r8_lr3e-3"]
    kept = {path.name.split("-epoch")[0]: path for path in tmp_path.glob("lightning_logs/version_0/checkpoints/*")}
    assert sorted(kept) == names  # one ModelCheckpoint per adapter, by its own `val_acc/<name>`
    for name in names:
        assert re.search(rf"{re.escape(name)}: val_acc \d\.\d+", output)
    winner = re.search(r"best adapter of the sweep: (\S+)", output).group(1)
    saved = torch.load(kept[winner], weights_only=True)
    assert sorted(saved["frozen_base"]["peft_adapters"]) == names
    # per adapter: 6 layers x (query, value) x (A, B) + the classifier's A and B; nothing else trains
    assert len(saved["state_dict"]) == 3 * 26
    assert [group["initial_lr"] for group in saved["optimizer_states"][0]["param_groups"]] == [1e-3, 3e-3, 3e-3]
    config = json.loads((tmp_path / "peft_adapter" / "adapter_config.json").read_text())
    assert config["r"] == int(winner[1])
    assert sorted(config["target_modules"]) == ["classifier", "query", "value"]
    difference = float(re.search(r"max \|logit difference\| between the two reloads: (\S+)", output).group(1))
    assert difference <= 1e-4
