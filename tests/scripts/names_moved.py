"""Move one private name of another package at a time, as a release would, in this fresh process, and write what the
package did to ``<report>``: for each optional capability, a plain 1-rank fit that does not ask for it (and a save
after it), with the warnings that named the moved name; a plain fit with one name of every optional capability moved
at once; a capability asked for by argument, and the core, at construction; the entry points that need a capability,
called.

A name is deleted (``delattr`` on its module or class) where the fit does not call it itself; where DeepSpeed's own
step calls it, it is replaced by a function that calls the original under another signature and no longer names the
attribute the package relies on, as a release that moved that attribute elsewhere would leave it.
"""

from __future__ import annotations

import json
import pkgutil
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import lightning_frozen  # noqa: E402
from lightning_frozen import DependencyDriftError, FrozenAwareDeepSpeedStrategy, capabilities, lightning_seam  # noqa: E402
from tests.models import AdapterModel, cpu_trainer, regression_data  # noqa: E402

_OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
# capability: (owner, name, how a release moved it)
PLAIN_FIT = {
    "PREEMPTION": (
        "lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector",
        "_slurm_sigusr_handler_fn",
        "delete",
    ),
    "RESUMED_EPOCH": ("lightning.pytorch.loops.fit_loop:_FitLoop", "reset_restart_stage", "replace"),
    "SCALER_RESUME": ("deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler", "update_scale", "replace"),
    "SCHEDULER_INTERNALS": ("torch.optim.lr_scheduler:SequentialLR", "__init__", "replace"),
    "PEFT_LAYERS": ("peft.tuners.tuners_utils:BaseTuner", "inject_adapter", "replace"),
    "ZERO3_SWITCH": ("transformers.integrations.deepspeed", "_hf_deepspeed_config_weak_ref", "delete"),
    "CPU_COMPUTE": ("torch._C", "_storage_Use_Count", "delete"),
    "SLICED_LOADING": ("transformers.modeling_utils", "_load_state_dict_into_zero3_model", "delete"),
    "GENERATE": (
        "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator",
        "release_and_reset_all",
        "replace",
    ),
    "SEVERAL_ADAPTERS": ("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "_get_norm_groups", "replace"),
    "UNFREEZING": ("lightning.pytorch.callbacks.finetuning:BaseFinetuning", "_store", "delete"),
    "CONVERT": ("deepspeed.utils.zero_to_fp32", "_zero3_merge_trainable_params", "delete"),
    "MERGE_CHECK": ("peft.tuners.tuners_utils:BaseTuner", "_check_merge_allowed", "delete"),
    "CONVERTED_LOADING": ("transformers.core_model_loading", "dot_natural_key", "delete"),
    "CONVERTED_EXPORT": ("transformers.core_model_loading", "revert_weight_conversion", "delete"),
    "ROUTED_EXPERTS": ("transformers.integrations.moe", "use_experts_implementation", "delete"),
    "RELEASE": (f"{_OFFLOAD}:ZeROOrderedDict", "__init__", "replace"),
    "TRACE": (f"{_OFFLOAD}:DeepSpeedZeRoOffload", "setup_zero_stage3_hooks", "replace"),
    "HOOKS_WHERE_PARAMS": (f"{_OFFLOAD}:DeepSpeedZeRoOffload", "_register_deepspeed_module", "replace"),
    "EARLY_CKPT_CHECK": ("lightning.pytorch:Trainer", "_run", "replace"),
}


def moved(owner_name: str, name: str, how: str) -> Callable[[], None]:
    """Move ``owner.name``; return what puts it back. The lookup of moved names starts afresh."""
    owner = pkgutil.resolve_name(owner_name)
    original = vars(owner)[name]
    if how == "delete":
        delattr(owner, name)
    else:

        def elsewhere(self: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self, *args, **kwargs)

        setattr(owner, name, elsewhere)
    capabilities.moved_names.cache_clear()
    return lambda: setattr(owner, name, original)


def trainable_values(model: torch.nn.Module) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


class SigtermHandlerSeen(Callback):
    """Whether Lightning's own SIGTERM handler is the one set while the run trains."""

    lightnings = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        handler = signal.getsignal(signal.SIGTERM)
        handlers = getattr(handler, "signal_handlers", [handler])  # Lightning's composes its handlers
        self.lightnings = any(lightning_seam.is_lightnings_signal_handler(h) for h in handlers)


def fit_and_save(path: Path) -> tuple[bool, list[str], bool]:
    """A plain 3-step fit of an adapter model, saved to ``path``: whether every trainable param changed, the warnings
    it gave, and whether Lightning's own SIGTERM handler was the one set while it trained."""
    model = AdapterModel()
    before = trainable_values(model)
    seen = SigtermHandlerSeen()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = cpu_trainer(max_steps=3, callbacks=[seen])
        trainer.fit(model, regression_data())
        trainer.save_checkpoint(path)
    after = trainable_values(model)
    trained = all(not torch.equal(b, a) for b, a in zip(before, after))
    return trained, [str(w.message) for w in caught], seen.lightnings


def plain_fit(name: str, folder: Path) -> dict[str, Any]:
    trained, messages, lightnings = fit_and_save(folder / f"{name}.ckpt")
    saved = torch.load(folder / f"{name}.ckpt", weights_only=True)["state_dict"]
    return dict(
        warnings=[message for message in messages if name in message],
        trained=trained,
        saved=sorted(saved),
        lightnings_sigterm_handler=lightnings,
    )


def all_moved_fit(folder: Path) -> dict[str, Any]:
    """A plain fit and save with a name of every optional capability moved at once: whether it trained, and how many
    warnings said that each capability is off."""
    put_back = [moved(owner, name, how) for owner, name, how in PLAIN_FIT.values()]
    capabilities._warn_off.cache_clear()  # each was warned of, alone, above: count this fit's own warnings
    trained, messages, _ = fit_and_save(folder / "all_moved.ckpt")
    for put in reversed(put_back):
        put()
    off = {capability: f"{getattr(capabilities, capability).name} is off" for capability in PLAIN_FIT}
    return dict(
        trained=trained,
        warnings={capability: sum(said in message for message in messages) for capability, said in off.items()},
    )


def raised(call: Callable[[], Any]) -> str:
    try:
        call()
    except DependencyDriftError as error:
        return str(error)
    return ""


def main() -> None:
    report, folder = Path(sys.argv[1]), Path(sys.argv[2])
    found: dict[str, Any] = {}
    for capability, (owner, name, how) in PLAIN_FIT.items():
        put_back = moved(owner, name, how)
        found[capability] = plain_fit(name, folder)
        if capability == "GENERATE":
            found["GENERATE asked"] = raised(lambda: FrozenAwareDeepSpeedStrategy(generation_memory="1GB"))
        if capability == "CONVERT":
            found["CONVERT used"] = raised(lambda: lightning_frozen.convert_deepspeed_checkpoint(folder, folder / "x"))
        put_back()
    found["ALL"] = all_moved_fit(folder)
    put_back = moved("lightning.pytorch.strategies:DeepSpeedStrategy", "_init_optimizers", "delete")
    found["CORE"] = raised(FrozenAwareDeepSpeedStrategy)
    # loading without DeepSpeed reads none of the core's names: it loads as before
    found["load_adapter, the core moved"] = raised(
        lambda: lightning_frozen.load_adapter(AdapterModel(), folder / "all_moved.ckpt", verify_base=False)
    )
    put_back()
    report.write_text(json.dumps(found))


if __name__ == "__main__":
    main()
