"""The ``lightning-frozen`` command: fit from YAML with the strategy by name and by class_path, command-line
overrides, ``--print_config`` and help for the strategy's options, resume, the console script, and ``convert``."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DeepSpeedStrategy

import lightning_frozen
from lightning_frozen import FrozenAwareDeepSpeedStrategy, cli
from lightning_frozen.cli import lightning_cli, main
from tests.cli_support import SavedHparamsAdapterModel, command_env
from tests.distributed import fresh_env
from tests.models import AdapterModel, StockDeepSpeedOnCPU, cpu_trainer, regression_data

REPO = Path(__file__).resolve().parents[1]
CLASS_PATH = "lightning_frozen.FrozenAwareDeepSpeedStrategy"
TRAINABLE = ["head.bias", "head.weight", "layers.0.lora_a", "layers.0.lora_b", "layers.1.lora_a", "layers.1.lora_b"]


def _config(folder: Path, strategy: Any, model: str = "tests.cli_support.SavedHparamsAdapterModel") -> Path:
    """A fit config on the CPU whose ModelCheckpoint writes ``<default_root_dir>/checkpoints/adapter.ckpt``."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "strategy": strategy,
            "max_epochs": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(folder / "run"),
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"filename": "adapter"}}
            ],
        },
        "model": {"class_path": model},
        "data": {"class_path": "tests.cli_support.RegressionData"},
    }
    path = folder / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _cli(*args: str) -> LightningCLI:
    with warnings.catch_warnings():
        # LightningCLI warns when given args while pytest's own sys.argv is set.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return lightning_cli(list(args))


def _exit_output(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the command for an action that prints and exits (help, print_config); return what it printed."""
    with pytest.raises(SystemExit) as exited, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        main(list(args))
    assert exited.value.code in (0, None)
    return capsys.readouterr().out


def _console(*args: str) -> subprocess.CompletedProcess:
    """Run the ``lightning-frozen`` console script from the repository root; fail with its output if it fails."""
    script = Path(sys.executable).with_name("lightning-frozen")
    result = subprocess.run(
        [str(script), *args], cwd=REPO, env=command_env(), capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def _strategy_options() -> set[str]:
    """Every argument of the strategy: DeepSpeedStrategy's, then its own."""
    names: set[str] = set()
    for cls in (FrozenAwareDeepSpeedStrategy, DeepSpeedStrategy):
        for parameter in inspect.signature(cls.__init__).parameters.values():
            if parameter.name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD:
                names.add(parameter.name)
    return names


def _help_by_option(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``--trainer.strategy.help``'s text for each strategy option, without its ``(type: ..., default: ...)``."""
    text = _exit_output(capsys, "fit", "--trainer.strategy.help", "FrozenAwareDeepSpeedStrategy")
    sections = re.split(r"\n  --trainer\.strategy\.([\w.]+)\b[^\n]*", text.split("\n\n", 2)[-1])
    return {
        name: " ".join(body.split("(type:")[0].split())
        for name, body in zip(sections[1::2], sections[2::2])
        if not name.endswith(".help")  # "--x.help CLASS": jsonargparse's own text, not the option's
    }


def test_fit_by_strategy_name_trains_and_writes_one_adapter_file(tmp_path: Path) -> None:
    cli = _cli("fit", "--config", str(_config(tmp_path, "frozen_deepspeed")))

    strategy = cli.trainer.strategy
    assert isinstance(strategy, FrozenAwareDeepSpeedStrategy)
    assert strategy.offload_frozen and strategy.zero_stage_3 and not strategy.offload_optimizer
    path = tmp_path / "run" / "checkpoints" / "adapter.ckpt"
    assert path.is_file()
    saved = torch.load(path, weights_only=True)
    assert sorted(saved["state_dict"]) == TRAINABLE
    initial = dict(SavedHparamsAdapterModel().named_parameters())
    for name in TRAINABLE:
        assert not torch.equal(saved["state_dict"][name], initial[name].detach()), f"{name} did not train"
    assert saved["hyper_parameters"]["_class_path"] == "tests.cli_support.SavedHparamsAdapterModel"


def test_class_path_init_args_and_command_line_overrides_reach_the_strategy_and_the_checkpoint(tmp_path: Path) -> None:
    strategy = {
        "class_path": CLASS_PATH,
        "init_args": {
            "offload_frozen": False,
            "fingerprint": "sha256",
            "frozen_base": "tests/base-from-yaml",
            "allgather_bucket_size": 12345,
        },
    }
    config = _config(tmp_path, strategy)

    cli = _cli("fit", "--config", str(config), "--trainer.strategy.init_args.frozen_base=tests/base-from-cli")

    strategy_object = cli.trainer.strategy
    assert type(strategy_object) is FrozenAwareDeepSpeedStrategy
    assert strategy_object.offload_frozen is False
    assert strategy_object.fingerprint == "sha256"
    assert strategy_object.config["zero_optimization"]["allgather_bucket_size"] == 12345
    saved = torch.load(tmp_path / "run" / "checkpoints" / "adapter.ckpt", weights_only=True)
    assert saved["frozen_base"]["reference"] == "tests/base-from-cli"
    assert saved["frozen_base"]["fingerprint"]["mode"] == "sha256"


def test_resume_through_the_cli_continues_from_the_adapter_file(tmp_path: Path) -> None:
    config = str(_config(tmp_path, "frozen_deepspeed"))
    _cli("fit", "--config", config)
    first = tmp_path / "run" / "checkpoints" / "adapter.ckpt"

    _cli(
        "fit",
        "--config",
        config,
        f"--trainer.default_root_dir={tmp_path / 'resumed'}",
        "--trainer.max_epochs=2",
        f"--ckpt_path={first}",
    )

    before = torch.load(first, weights_only=True)
    after = torch.load(tmp_path / "resumed" / "checkpoints" / "adapter.ckpt", weights_only=True)
    assert (before["epoch"], before["global_step"]) == (0, 8)
    assert (after["epoch"], after["global_step"]) == (1, 16)
    assert not torch.equal(after["state_dict"]["layers.0.lora_b"], before["state_dict"]["layers.0.lora_b"])


def test_a_checkpoint_written_by_the_cli_loads_with_load_from_checkpoint(tmp_path: Path) -> None:
    _cli("fit", "--config", str(_config(tmp_path, "frozen_deepspeed")))
    path = tmp_path / "run" / "checkpoints" / "adapter.ckpt"

    module = lightning_frozen.load_from_checkpoint(SavedHparamsAdapterModel, path)

    saved = torch.load(path, weights_only=True)["state_dict"]
    params = dict(module.named_parameters())
    assert saved and saved.keys() <= params.keys(), sorted(saved.keys() - params.keys())
    for name, value in saved.items():
        assert torch.equal(params[name].detach(), value.to(params[name].dtype)), name


def test_print_config_lists_every_strategy_option_and_a_name_can_become_a_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(_config(tmp_path, "frozen_deepspeed"))

    by_name = yaml.safe_load(_exit_output(capsys, "fit", "--config", config, "--print_config"))
    as_class = yaml.safe_load(
        _exit_output(
            capsys,
            "fit",
            "--config",
            config,
            "--trainer.strategy=FrozenAwareDeepSpeedStrategy",
            "--trainer.strategy.convert_lr_zero_groups=false",
            "--print_config",
        )
    )

    assert by_name["trainer"]["strategy"] == "frozen_deepspeed"
    strategy = as_class["trainer"]["strategy"]
    assert strategy["class_path"] == CLASS_PATH
    assert set(strategy["init_args"]) == _strategy_options()
    assert strategy["init_args"]["convert_lr_zero_groups"] is False
    assert strategy["init_args"]["offload_frozen"] is True


def test_the_strategy_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    helps = _help_by_option(capsys)

    assert set(helps) == _strategy_options()
    assert {option for option, text in helps.items() if not text} == set()
    for option in ("stage", "offload_frozen", "offload_optimizer", "convert_lr_zero_groups", "frozen_base"):
        assert len(helps[option]) > 20, (option, helps[option])
    assert "sha256" in helps["fingerprint"]


def test_the_default_strategy_is_frozen_deepspeed(capsys: pytest.CaptureFixture[str]) -> None:
    printed = yaml.safe_load(_exit_output(capsys, "fit", "--print_config"))

    assert printed["trainer"]["strategy"] == "frozen_deepspeed"


@pytest.mark.slow
def test_the_console_script_fits_a_yaml_config_from_the_project_directory(tmp_path: Path) -> None:
    config = _config(tmp_path, "frozen_deepspeed_no_offload", model="tests.models.AdapterModel")

    printed = _console(
        "fit",
        "--config",
        str(config),
        "--trainer.strategy=FrozenAwareDeepSpeedStrategy",
        "--trainer.strategy.fingerprint=none",
        "--print_config",
    )
    result = _console("fit", "--config", str(config))

    init_args = yaml.safe_load(printed.stdout)["trainer"]["strategy"]["init_args"]
    assert set(init_args) == _strategy_options() and init_args["fingerprint"] == "none"
    output = result.stdout + result.stderr
    assert "lightning-frozen: 545 trainable / 2,112 frozen params on 1 rank(s)" in output
    saved = torch.load(tmp_path / "run" / "checkpoints" / "adapter.ckpt", weights_only=True)
    assert sorted(saved["state_dict"]) == TRAINABLE
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["trainer"]["strategy"] == "frozen_deepspeed_no_offload"


def _refusal(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the command for a config it refuses: check it exits with status 2 and prints no traceback and no parsed
    config; return the last line it printed on stderr."""
    with pytest.raises(SystemExit) as exited, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        main(list(args))
    printed = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in printed and "Namespace(" not in printed, printed
    return printed.splitlines()[-1]


def test_a_class_this_package_refuses_is_one_line_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stage_two = _config(tmp_path, {"class_path": CLASS_PATH, "init_args": {"stage": 2}})
    assert _refusal(capsys, "fit", "--config", str(stage_two)) == (
        "lightning-frozen: error: FrozenAwareDeepSpeedStrategy shards frozen params with ZeRO stage 3; got `stage=2`."
        " Use Lightning's `DeepSpeedStrategy` for stages 1 and 2."
    )
    missing = tmp_path / "missing.ckpt"
    from_file = _config(tmp_path, "frozen_deepspeed", model="tests.cli_support.AdapterFromFile")
    refusal = _refusal(capsys, "fit", "--config", str(from_file), f"--model.init_args.adapter={missing}")
    assert refusal == f"lightning-frozen: error: No checkpoint at {missing}: check the path."


def test_a_bug_in_the_users_class_keeps_its_traceback(tmp_path: Path) -> None:
    buggy = _config(tmp_path, "frozen_deepspeed", model="tests.cli_support.BuggyAdapterModel")
    with pytest.raises(Exception) as raised:
        _cli("fit", "--config", str(buggy))
    causes = [raised.value]
    while causes[-1].__cause__ is not None:
        causes.append(causes[-1].__cause__)
    assert isinstance(causes[-1], KeyError) and causes[-1].__traceback__ is not None


def test_validate_with_a_wrong_ckpt_path_fails_before_deepspeed_starts(tmp_path: Path, lightning_log: Any) -> None:
    config = _config(tmp_path, "frozen_deepspeed")
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(lightning_frozen.CheckpointNotFoundError, match=r"nope.ckpt \(the `ckpt_path` of `validate`\)"):
        _cli("validate", "--config", str(config), "--ckpt_path", str(missing))
    assert "initializing deepspeed distributed" not in lightning_log.text


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory written by Lightning's own DeepSpeedStrategy (ZeRO-3, on the CPU)."""
    folder = tmp_path_factory.mktemp("stock") / "stock.ckpt"
    trainer = cpu_trainer(StockDeepSpeedOnCPU(stage=3), max_epochs=1)
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(folder)
    return folder


def test_convert_writes_an_adapter_file_from_a_stock_deepspeed_directory(
    stock_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "converted.ckpt"

    main(["convert", str(stock_checkpoint), str(out), "--reference", "tests/stock-base"])

    assert f"wrote {out}" in capsys.readouterr().out
    saved = torch.load(out, weights_only=True)
    assert sorted(saved["state_dict"]) == TRAINABLE
    assert saved["frozen_base"]["reference"] == "tests/stock-base"
    lightning_frozen.load_adapter(AdapterModel(), out)


def test_convert_explains_its_arguments_and_failures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["convert", "--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out
    assert "lightning-frozen convert" in usage and "src_dir" in usage and "--reference" in usage

    with pytest.raises(SystemExit) as exited:
        main(["convert", str(tmp_path / "src")])
    assert exited.value.code == 2
    assert "dst_file" in capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    for source, reason in ((tmp_path / "missing", "No DeepSpeed checkpoint"), (tmp_path / "empty", "does not look")):
        with pytest.raises(SystemExit) as exited:
            main(["convert", str(source), str(tmp_path / "out.ckpt")])
        assert exited.value.code == 1
        error = capsys.readouterr().err
        assert error.startswith("lightning-frozen convert: error:") and reason in error and str(source) in error
    assert not (tmp_path / "out.ckpt").exists()


def test_help_and_an_unknown_subcommand_list_every_step(capsys: pytest.CaptureFixture[str]) -> None:
    steps = ["fit", "validate", "test", "predict", "export-peft", "export-merged", "convert", "cache", "estimate"]
    assert cli.subcommands() == steps
    help_text = " ".join(_exit_output(capsys, "--help").split())
    assert all(step in help_text for step in steps), help_text

    with pytest.raises(SystemExit) as exited:
        main(["export", "adapter.ckpt", "out/"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "lightning-frozen: error: invalid choice: 'export' (choose from 'fit', 'validate', 'test', 'predict',"
        " 'export-peft', 'export-merged', 'convert', 'cache', 'estimate'); see `lightning-frozen --help`"
    )


def test_export_peft_writes_the_folder_peft_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.peft_models import PeftModule, batches

    trainer = cpu_trainer(max_steps=2)
    trainer.fit(PeftModule("lora_modules_to_save"), batches("lora_modules_to_save"))
    trainer.save_checkpoint(tmp_path / "adapter.ckpt", weights_only=False)

    main(["export-peft", str(tmp_path / "adapter.ckpt"), str(tmp_path / "out")])

    assert f"lightning-frozen export-peft: wrote {tmp_path / 'out'}" in capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    with pytest.raises(SystemExit) as exited:
        main(["export-peft", str(tmp_path / "missing.ckpt"), str(tmp_path / "out2")])
    assert exited.value.code == 1
    assert capsys.readouterr().err.startswith("lightning-frozen export-peft: error: No checkpoint at")


def _estimate_table(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, str]:
    """``lightning-frozen estimate ARGS``: its first line, and each row of its table by name."""
    main(["estimate", *args])
    first, *rows = capsys.readouterr().out.splitlines()
    table = {re.split(r"\s{2,}", row)[0]: re.split(r"\s{2,}", row)[1] for row in rows}
    return {"first": first, **table}


def test_estimate_from_a_config_json_or_a_lightningcli_config_says_what_it_assumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.peft_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "llama")
    plain = _estimate_table(capsys, str(folder / "config.json"), "--devices", "2")
    assert (
        "assumed precision 32-true (the Trainer's default), frozen_dtype None (the strategy's default), LoRA r=8"
        " (`--lora-r`, default) on PEFT's default modules for the model type (`--target-modules`)" in (plain["first"])
    )
    assert (plain["precision"], plain["frozen dtype"], plain["ranks"]) == ("32-true", "None", "2")
    # PEFT's choice for Llama, r=8 on q_proj (64 -> 64) and v_proj (64 -> 32, two key-value heads), two layers
    assert plain["trainable params"] == f"{2 * 8 * (64 + 64 + 64 + 32):,}"

    config = tmp_path / "fit.yaml"
    strategy = {"class_path": CLASS_PATH, "init_args": {"frozen_dtype": "nf4"}}
    config.write_text(yaml.safe_dump({"trainer": {"precision": "bf16-mixed", "devices": 2, "strategy": strategy}}))
    from_yaml = _estimate_table(capsys, str(config), "--base", str(folder))
    assert (
        "assumed precision bf16-mixed (the config's), frozen_dtype nf4 (the config's), LoRA r=8" in from_yaml["first"]
    )
    assert (from_yaml["precision"], from_yaml["frozen dtype"], from_yaml["ranks"]) == ("bf16-mixed", "nf4", "2")

    config.write_text(_config(tmp_path, "frozen_deepspeed").read_text())
    built = _estimate_table(capsys, str(config), "--precision", "bf16-true")
    assert "assumed precision bf16-true (given)" in built["first"] and "LoRA" not in built["first"]  # the module's
    assert (built["trainable params"], built["frozen params"]) == ("545", "2,112")  # SavedHparamsAdapterModel


def test_a_registered_name_in_yaml_takes_strategy_options_on_the_command_line(tmp_path: Path) -> None:
    config = _config(tmp_path, "frozen_deepspeed_no_offload")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        main(["fit", "--config", str(config), "--trainer.strategy.fingerprint=none", "--trainer.max_steps=1"])

    saved = torch.load(tmp_path / "run" / "checkpoints" / "adapter.ckpt", weights_only=True)
    assert saved["frozen_base"]["fingerprint"]["mode"] == "none"  # the option reached the strategy
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["trainer"]["strategy"]
    assert written["class_path"] == CLASS_PATH and written["init_args"]["offload_frozen"] is False  # the name's


def test_a_registered_name_on_the_command_line_becomes_its_class_before_the_first_option() -> None:
    given = ["fit", "--trainer.strategy", "frozen_deepspeed_offload", "--trainer.strategy.frozen_dtype=nf4"]
    assert cli.strategy_named_with_options(given) == [
        "fit",
        "--trainer.strategy=FrozenAwareDeepSpeedStrategy",
        "--trainer.strategy.offload_optimizer=true",
        "--trainer.strategy.frozen_dtype=nf4",
    ]
    as_class = ["fit", "--trainer.strategy=FrozenAwareDeepSpeedStrategy", "--trainer.strategy.frozen_dtype=nf4"]
    assert cli.strategy_named_with_options(as_class) == as_class
    stock = ["fit", "--trainer.strategy=deepspeed_stage_3", "--trainer.strategy.stage=3"]
    assert cli.strategy_named_with_options(stock) == stock  # another package's name: jsonargparse's own answer


def test_help_prints_no_deepspeed_accelerator_warning() -> None:
    code = "from lightning_frozen.cli import main; main(['--help'])"
    env = fresh_env()
    env.pop("DS_ACCELERATOR", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)

    assert result.returncode == 0, result.stderr[-2000:]
    assert "export-peft" in result.stdout
    assert "accelerator" not in result.stderr, result.stderr  # DeepSpeed's "Setting accelerator to CPU" warning


def test_the_command_line_warns_of_no_args_and_advises_its_export_steps_after_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lightning_log: Any
) -> None:
    monkeypatch.setattr(
        sys, "argv", ["lightning-frozen", "fit", "--config", str(_config(tmp_path, "frozen_deepspeed"))]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main()
    assert not [w for w in caught if "LightningCLI's args parameter" in str(w.message)]
    saved = tmp_path / "run" / "checkpoints" / "adapter.ckpt"
    advice = [line for line in lightning_log.lines if "lightning-frozen export-peft" in line]
    assert advice == [
        "lightning-frozen: the trained adapter is in the run's checkpoint file. For inference or serving,"
        f" `lightning-frozen export-peft {saved} OUT_DIR` writes a PEFT adapter folder and `lightning-frozen"
        f" export-merged {saved} OUT_DIR` a Hugging Face folder with the adapter merged into its base"
        " (`lightning-frozen STEP --help`)."
    ]
    assert not [line for line in lightning_log.lines if "unshard" in line]


def test_estimate_of_a_config_json_prints_no_deprecation_from_its_own_lora(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.peft_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each time, not once per place: an earlier test may have shown it
        _estimate_table(capsys, str(folder / "config.json"))
    assert [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)] == []


def test_estimate_takes_lora_on_a_moes_fused_experts_as_peft_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoConfig

    from tests.pretrained_support import EXPERTS, MOE_CONFIGS, TINY_LLAMA

    config = AutoConfig.for_model("qwen3_moe", **TINY_LLAMA, **MOE_CONFIGS["qwen3_moe"])
    config.save_pretrained(tmp_path / "moe")  # the config alone: the estimate builds the model on the meta device
    source, attention = str(tmp_path / "moe" / "config.json"), ["--lora-r", "4", "--target-modules", "q_proj"]
    plain = _estimate_table(capsys, source, *attention)
    assert "its fused experts untouched (`--target-parameters`)" in plain["first"]
    experts = _estimate_table(capsys, source, *attention, "--target-parameters", *EXPERTS)
    assert f"on q_proj (given) and on the parameters {', '.join(EXPERTS)} (given)" in experts["first"]
    # PEFT's ParamWrapper: lora_A [r*E, in], lora_B [out, r*E] per fused tensor; E=4 experts, gate_up [4, 48, 64] and
    # down [4, 64, 24] in each of two layers
    rank_e = 4 * 4
    per_layer = rank_e * 64 + 48 * rank_e + rank_e * 24 + 64 * rank_e
    trainable = {
        name: int(table["trainable params"].replace(",", ""))
        for name, table in (("plain", plain), ("experts", experts))
    }
    assert trainable["experts"] - trainable["plain"] == 2 * per_layer
    assert experts["frozen params"] == plain["frozen params"] and experts["experts"] == plain["experts"]
