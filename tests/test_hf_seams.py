"""The Hugging Face seam and the private names of other packages (issue 20).

transformers and PEFT are imported only in ``lightning_frozen/hf/``, and their internals are read only there; every
private name the package takes from another package (DeepSpeed, Lightning, transformers, PEFT, torch) is listed in
docs/internals.md's section "Private names of other packages". Each checker is a function over source text, shown to
fail on a small example.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

import lightning_frozen
from lightning_frozen.hf import peft_adapters, transformers_loading
from lightning_frozen.zero import accelerator
from tests.models import AdapterModel, StockDeepSpeedOnCPU, cpu_trainer, regression_data

PACKAGE = Path(lightning_frozen.__file__).parent
INTERNALS = PACKAGE.parent / "docs" / "internals.md"
PINNED_HEADING = "## Private names of other packages"
HF_PACKAGES = ("transformers", "peft")
# transformers' and PEFT's internals the package relies on: private names, and LoRA layer parts that are no API
HF_INTERNALS = {
    "_load_state_dict_into_zero3_model",
    "_hf_deepspeed_config_weak_ref",
    "_is_ds_init_called",
    "_is_hf_initialized",
    "base_layer",
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_variant",
    "adapter_layer_names",
    # a bitsandbytes quantization_config taken off `from_pretrained` (hf/transformers_loading.py)
    "get_hf_quantizer",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "llm_int8_skip_modules",
    "is_loaded_in_4bit",
    "is_loaded_in_8bit",
    "Params4bit",
    "Int8Params",
}
# Python's own documented names that start with an underscore (`os._exit`, a namedtuple's `_fields`)
PYTHON_API = {"_exit", "_fields"}
# the package's own private attribute, set on tensors by name (base/pretrained.py)
OWN_ATTRIBUTES = {"_lightning_frozen_source"}


def _private(name: str) -> bool:
    return len(name) > 1 and name.startswith("_") and not name.startswith("__")


def _sources() -> dict[str, str]:
    """Each package module's source by its dotted name under the package ("strategy", "hf.peft_adapters"), but the
    table of other packages' private names (``capabilities.py``), which names them as text and reaches none."""
    paths = sorted(path for path in PACKAGE.rglob("*.py") if path != PACKAGE / "capabilities.py")
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): path.read_text()
        for path in paths
    }


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _walk_outside_type_checking(tree: ast.AST) -> Iterable[ast.AST]:
    for child in ast.iter_child_nodes(tree):
        if _type_checking_block(child):
            continue
        yield child
        yield from _walk_outside_type_checking(child)


def hf_imports(source: str) -> list[str]:
    """``line: statement`` for each import of transformers or PEFT in ``source`` outside ``if TYPE_CHECKING:``."""
    found = []
    for node in _walk_outside_type_checking(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name.split(".")[0] in HF_PACKAGES for name in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _attribute_names(tree: ast.AST) -> Iterable[tuple[ast.AST, str]]:
    """Every attribute name ``tree`` reads or writes: ``x.name``, and each string that is a name (``getattr(x,
    "name")``, a tuple of attribute names to copy)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node, node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            yield node, node.value


def hf_internals_read(source: str) -> list[str]:
    """``line: name`` for each of :data:`HF_INTERNALS` that ``source`` reads or writes as an attribute."""
    return [f"{node.lineno}: {name}" for node, name in _attribute_names(ast.parse(source)) if name in HF_INTERNALS]


def own_private_names(sources: Iterable[str]) -> set[str]:
    """The private names the package defines itself: module- and class-level functions, classes and constants, the
    attributes it assigns on ``self``, and :data:`OWN_ATTRIBUTES`."""
    own = set(OWN_ATTRIBUTES)
    for source in sources:
        tree = ast.parse(source)
        bodies = [tree.body, *(node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef))]
        for statement in (statement for body in bodies for statement in body):
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(statement.name)
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                own.update(name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name))
        stores = (
            node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        )
        own.update(node.attr for node in stores if ast.unparse(node.value) == "self")
    return {name for name in own if _private(name)}


def foreign_private_names(source: str, own: set[str]) -> dict[str, list[int]]:
    """The private names ``source`` takes from other packages, with the lines: ``from pkg import _x``, an attribute
    ``_x`` (``a._x``, ``getattr(a, "_x")``) that the package does not define itself (``own``), and any ``super()._x``.
    Names bound from the package itself (``from lightning_frozen... import``) are tests/test_structure.py's concern.
    """
    found: dict[str, list[int]] = {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] != "lightning_frozen"
        ):
            for alias in node.names:
                if _private(alias.name):
                    found.setdefault(alias.name, []).append(node.lineno)
    for node, name in _attribute_names(tree):
        inherited = isinstance(node, ast.Attribute) and ast.unparse(node.value) == "super()"
        if _private(name) and name not in PYTHON_API and (inherited or name not in own):
            found.setdefault(name, []).append(node.lineno)
    return found


def overridden_private_methods(module_name: str, source: str) -> dict[str, list[int]]:
    """Private methods that a class of the package module defines over a class of another package (a hook of
    Lightning's it overrides), and the private attributes it reads on ``self`` that such a class defines."""
    module = importlib.import_module(
        "lightning_frozen" if module_name == "__init__" else f"lightning_frozen.{module_name}"
    )
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(source)):
        cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
        if not inspect.isclass(cls):
            continue
        foreign = [base for base in cls.__mro__[1:] if not base.__module__.startswith(("lightning_frozen", "builtins"))]
        for inner in ast.walk(node):
            name = inner.name if isinstance(inner, ast.FunctionDef) else getattr(inner, "attr", None)
            if name and _private(name) and any(name in vars(base) for base in foreign):
                found.setdefault(name, []).append(inner.lineno)
    return found


def pinned_section(page: str) -> str:
    """The text under :data:`PINNED_HEADING` in ``page`` (docs/internals.md), up to the next heading of its level."""
    _, found, after = page.partition(f"\n{PINNED_HEADING}\n")
    assert found, f"{INTERNALS} has no heading {PINNED_HEADING!r}: the private names of other packages are listed there"
    return after.split("\n## ")[0]


def missing_from(paragraph: str, names: Iterable[str]) -> list[str]:
    """The ``names`` that ``paragraph`` does not mention as a whole word."""
    return sorted(name for name in names if not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", paragraph))


def package_private_names() -> dict[str, list[str]]:
    """Every private name of another package that the package uses: ``{name: ["module:line", ...]}``."""
    sources = _sources()
    own = own_private_names(sources.values())
    found: dict[str, list[str]] = {}
    for module_name, source in sources.items():
        uses = foreign_private_names(source, own)
        for name, lines in overridden_private_methods(module_name, source).items():
            uses.setdefault(name, []).extend(lines)
        for name, lines in uses.items():
            found.setdefault(name, []).extend(f"{module_name}:{line}" for line in sorted(set(lines)))
    return found


def test_only_the_hf_seam_imports_transformers_and_peft() -> None:
    outside = {name: source for name, source in _sources().items() if name.split(".")[0] != "hf"}
    assert {name: found for name, source in outside.items() if (found := hf_imports(source))} == {}


def test_only_the_hf_seam_reads_transformers_and_peft_internals() -> None:
    outside = {name: source for name, source in _sources().items() if name.split(".")[0] != "hf"}
    assert {name: found for name, source in outside.items() if (found := hf_internals_read(source))} == {}
    inside = "".join(source for name, source in _sources().items() if name.startswith("hf."))
    assert {name for name in HF_INTERNALS if not re.search(rf"\b{name}\b", inside)} == set()  # the list is live


def test_the_checkers_fail_on_an_import_or_an_internal_outside_the_seam() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n"
        "    from peft import PeftModel\n"
        "def reference(model):\n"
        "    import transformers.modeling_utils\n"
        "    from peft.tuners import lora\n"
        "    return model._is_ds_init_called or getattr(model, 'lora_A', None)\n"
    )
    assert hf_imports(source) == ["6: import transformers.modeling_utils", "7: from peft.tuners import lora"]
    assert hf_internals_read(source) == ["8: _is_ds_init_called", "8: lora_A"]


def test_the_private_name_collector_tells_foreign_names_from_the_packages_own() -> None:
    source = (
        "import os\n"
        "from lightning.fabric.utilities.types import _PATH\n"
        "from lightning_frozen.zero import params as _params\n"
        "class Strategy(Base):\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def step(self, engine):\n"
        "        super()._hook()\n"
        "        return self._mine, engine._theirs, getattr(engine, '_also'), self._inherited, os._exit\n"
    )
    own = own_private_names([source])
    assert own == {"_mine", *OWN_ATTRIBUTES}
    found = foreign_private_names(source, own)
    assert found == {"_PATH": [2], "_hook": [8], "_theirs": [9], "_also": [9], "_inherited": [9]}
    paragraph = "Pinned: Lightning 2.6 (`_PATH`, `Trainer._run`), torch (`_theirs`)."
    assert missing_from(paragraph, ["_PATH", "_run", "_theirs", "_also", "_PAT"]) == ["_PAT", "_also"]


def test_the_pinned_section_ends_at_the_next_heading_and_its_absence_fails() -> None:
    page = f"# Internals\n`_before`\n{PINNED_HEADING}\n\n- torch: `_version`\n\n- more: `_buffers`\n## Next\n`_after`\n"
    assert missing_from(pinned_section(page), ["_before", "_version", "_buffers", "_after"]) == ["_after", "_before"]
    with pytest.raises(AssertionError, match="has no heading"):
        pinned_section("# Internals\n\n## Private names\n`_version`\n")


def test_the_override_check_finds_lightning_hooks_the_seam_overrides() -> None:
    source = (PACKAGE / "lightning_seam.py").read_text()
    overridden = overridden_private_methods("lightning_seam", source)
    assert {"_init_optimizers", "_setup_model_and_optimizer"} <= set(overridden)
    strategy = overridden_private_methods("strategy", (PACKAGE / "strategy.py").read_text())
    assert "_placement" not in strategy  # the strategy's own property


# the homes of other packages' private names (issue 26): the DeepSpeed seam (with torch's few), the Hugging Face
# seam, and the Lightning seam
PRIVATE_NAME_HOMES = ("zero", "hf", "lightning_seam")


def test_private_names_of_other_packages_live_in_the_three_seams() -> None:
    used = package_private_names()
    elsewhere = {
        name: [where for where in places if where.split(".")[0].split(":")[0] not in PRIVATE_NAME_HOMES]
        for name, places in used.items()
    }
    assert {name: places for name, places in elsewhere.items() if places} == {}
    homes = {where.split(".")[0].split(":")[0] for places in used.values() for where in places}
    assert homes == set(PRIVATE_NAME_HOMES)  # each seam is still in use: the check reads the right modules


def test_every_private_name_of_another_package_is_listed_in_docs_internals() -> None:
    used = package_private_names()
    assert {"_partition_param", "_is_ds_init_called", "_slurm_sigusr_handler_fn", "_version"} <= set(used)
    section = pinned_section(INTERNALS.read_text())
    assert {name: used[name] for name in missing_from(section, used)} == {}  # add each to docs/internals.md


def test_dependency_deprecations_are_ignored_by_their_messages_only() -> None:
    messages = [
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single`",
        "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `torch.distributed.reduce_scatter_single`",
        "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`",
    ]
    others = ["`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead", "x"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", accelerator.DEPENDENCY_DEPRECATIONS, FutureWarning)
        for message in [*messages, *others]:
            warnings.warn(message, FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == others


class _FiltersDuringFit(Callback):
    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen.append(list(warnings.filters))


def test_fits_install_the_deprecation_filter_once_after_the_users_filters_and_take_it_off() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the user's own")
        before, during = list(warnings.filters), _FiltersDuringFit()
        for _ in range(2):  # two fits in one process
            trainer = cpu_trainer(max_steps=1, enable_checkpointing=False, callbacks=[during])
            trainer.fit(AdapterModel(), regression_data())
            assert warnings.filters == before  # a run leaves the process's filters as it found them
        assert len(during.seen) == 2  # one look per fit
        for filters in during.seen:
            ours = [f for f in filters if f[1] is not None and f[1].pattern == accelerator.DEPENDENCY_DEPRECATIONS]
            users = [f for f in filters if f[1] is not None and f[1].pattern == "the user's own"]
            assert len(ours) == 1 and filters.index(users[0]) < filters.index(ours[0])


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_peft_creation_wrapper_runs_around_the_outermost_call_only_and_is_removed() -> None:
    import peft
    from peft.tuners.tuners_utils import BaseTuner

    calls: list[str] = []
    originals = (peft.PeftModel.__init__, BaseTuner.inject_adapter)
    with peft_adapters.around_adapter_creation(lambda: calls.append("enter"), lambda: calls.append("leave")):
        assert peft.PeftModel.__init__ is not originals[0]
        model = peft.get_peft_model(_Tiny(), peft.LoraConfig(target_modules=["lin"], r=2))
        model.add_adapter("second", peft.LoraConfig(target_modules=["lin"], r=2))  # inject_adapter alone
    assert calls == ["enter", "leave", "enter", "leave"]
    assert (peft.PeftModel.__init__, BaseTuner.inject_adapter) == originals


def test_transformers_loading_steps_are_replaced_only_while_active() -> None:
    from transformers import modeling_utils
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    originals = (modeling_utils.load_state_dict, modeling_utils._load_state_dict_into_zero3_model)

    def shapes(original: Any, checkpoint_file: str, *args: Any, **kwargs: Any) -> dict:
        return {}

    def into(original: Any, model_to_load: nn.Module, state_dict: dict, load_config: Any = None) -> tuple:
        return [], set()

    with transformers_loading.zero3_loading({"zero_optimization": {"stage": 3}}, shapes, into) as patched:
        assert patched and is_deepspeed_zero3_enabled()
        assert modeling_utils.load_state_dict.func is shapes and modeling_utils.load_state_dict.args == originals[:1]
        assert modeling_utils._load_state_dict_into_zero3_model.func is into
    assert (modeling_utils.load_state_dict, modeling_utils._load_state_dict_into_zero3_model) == originals
    assert not is_deepspeed_zero3_enabled()


def test_convert_forces_weights_only_loads_for_deepspeeds_own_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "stock.ckpt"
    trainer = cpu_trainer(StockDeepSpeedOnCPU(stage=3), max_steps=1, enable_checkpointing=False)
    trainer.fit(AdapterModel(), regression_data())
    trainer.save_checkpoint(folder)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # the user's own setting
    loads, load = [], torch.load

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        loads.append((kwargs.get("weights_only"), os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    lightning_frozen.convert_deepspeed_checkpoint(folder, tmp_path / "converted.ckpt")
    assert (False, "1") in loads and (True, None) in loads  # DeepSpeed's read forced; ours explicit, env untouched
    assert set(loads) == {(False, "1"), (True, None)}
    assert (
        os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") == "1" and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    )
