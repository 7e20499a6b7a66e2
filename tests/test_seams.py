"""The DeepSpeed seam (issue 20): only ``lightning_frozen/zero/`` touches DeepSpeed, and its surface is documented.

Outside ``zero/`` no module imports ``deepspeed`` (except for type hints, under ``if TYPE_CHECKING:``), imports a
private DeepSpeed name, or touches a DeepSpeed internal: a ``ds_*`` attribute of a ZeRO-3 param, or one of the
attributes of DeepSpeed's optimizer and engine the seam reaches (:data:`DEEPSPEED_INTERNALS`). Every name other
modules take from ``zero/`` is listed in ``zero/__init__.py``'s docstring, and every name listed there is defined in
the module it is listed under.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning_frozen
import lightning_frozen.zero

PACKAGE = Path(lightning_frozen.__file__).parent
SEAM = PACKAGE / "zero"
OUTSIDE_SEAM = sorted(path for path in PACKAGE.rglob("*.py") if SEAM not in path.parents)

# DeepSpeed attributes without a `ds_` prefix or an underscore that the seam reads or writes (DeepSpeed 0.19):
# of the ZeRO-3 optimizer, its param offload, the engine's step counters, CPU Adam, the zero.Init context
DEEPSPEED_INTERNALS = frozenset(
    {
        "grad_position",
        "get_param_id",
        "fp32_partitioned_groups_flat",
        "persistent_parameters",
        "parameter_offload",
        "fwd_pre_hook",
        "forward_hooks",
        "loss_scaler",
        "global_steps",
        "global_samples",
        "micro_steps",
        "skipped_steps",
        "adam_w_mode",
        "top_level_context",
    }
)
_ATTRIBUTE_BUILTINS = ("getattr", "hasattr", "setattr", "delattr")
# a ZeRO-3 param's own gather and partition methods: replacing them re-implements DeepSpeed's handle contract
PARAM_METHODS = frozenset({"all_gather", "all_gather_coalesced", "partition"})


def _is_deepspeed_internal(name: str) -> bool:
    return name.startswith("ds_") or name in DEEPSPEED_INTERNALS


def _is_deepspeed(module: str) -> bool:
    return module == "deepspeed" or module.startswith("deepspeed.")


def _private(dotted: str) -> list[str]:
    return [part for part in dotted.split(".") if part.startswith("_") and not part.startswith("__")]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """The ids of the nodes inside an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) block."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
        if name == "TYPE_CHECKING":
            inside.update(id(child) for statement in node.body for child in ast.walk(statement))
    return inside


def deepspeed_violations(source: str, filename: str = "<string>") -> list[str]:
    """Where ``source``, a module outside the seam, touches DeepSpeed: ``"file:line what"`` per finding.

    Found: an import of ``deepspeed`` outside ``if TYPE_CHECKING:``; a private DeepSpeed name imported anywhere; an
    attribute named ``ds_*`` or in :data:`DEEPSPEED_INTERNALS`, read, written or deleted directly or through
    ``getattr``/``hasattr``/``setattr``/``delattr`` with the name as a string; ``importlib.import_module`` or
    ``__import__`` of a DeepSpeed module.
    """
    tree = ast.parse(source, filename)
    hinted = _type_checking_nodes(tree)
    found: list[str] = []

    def imported(node: ast.stmt, module: str, names: list[str]) -> None:
        private = _private(module) + [name for name in names if _private(name)]
        if private:
            found.append(f"{filename}:{node.lineno} imports DeepSpeed's private {', '.join(private)}")
        elif id(node) not in hinted:
            found.append(f"{filename}:{node.lineno} imports {module} outside `if TYPE_CHECKING:`")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_deepspeed(alias.name):
                    imported(node, alias.name, [])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_deepspeed(node.module or ""):
            imported(node, node.module or "", [alias.name for alias in node.names])
        elif isinstance(node, ast.Attribute) and _is_deepspeed_internal(node.attr):
            found.append(f"{filename}:{node.lineno} touches DeepSpeed's `{node.attr}`")
        elif isinstance(node, ast.Attribute) and node.attr in PARAM_METHODS and isinstance(node.ctx, ast.Store):
            found.append(f"{filename}:{node.lineno} replaces a ZeRO-3 param's `{node.attr}`")
        elif isinstance(node, ast.Call) and node.args:
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            first, second = node.args[0], node.args[1] if len(node.args) > 1 else None
            named = second.value if isinstance(second, ast.Constant) and isinstance(second.value, str) else ""
            if called in _ATTRIBUTE_BUILTINS and _is_deepspeed_internal(named):
                found.append(f"{filename}:{node.lineno} {called}s DeepSpeed's `{named}`")
            module = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
            if called in ("import_module", "__import__") and _is_deepspeed(module):
                found.append(f"{filename}:{node.lineno} imports {module} by name")
    return sorted(found, key=lambda line: int(line.split(":")[1].split()[0]))


def test_only_the_zero_subpackage_touches_deepspeed() -> None:
    found = [
        finding
        for path in OUTSIDE_SEAM
        for finding in deepspeed_violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == []


def test_the_deepspeed_check_finds_each_kind_of_touch() -> None:
    source = """
from typing import TYPE_CHECKING
import deepspeed
from deepspeed.utils import zero_to_fp32
from deepspeed.utils.zero_to_fp32 import _zero3_merge_frozen_params
if TYPE_CHECKING:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import _private_hint
shard = param.ds_tensor
param.ds_status = None
size = getattr(param, "ds_numel", 0)
offload.persistent_parameters[:] = []
module = importlib.import_module("deepspeed.comm")
param.all_gather, param.partition = gather, partition
message = "param.ds_tensor is a string, not an access"
"""
    assert deepspeed_violations(source, "m.py") == [
        "m.py:3 imports deepspeed outside `if TYPE_CHECKING:`",
        "m.py:4 imports deepspeed.utils outside `if TYPE_CHECKING:`",
        "m.py:5 imports DeepSpeed's private _zero3_merge_frozen_params",
        "m.py:8 imports DeepSpeed's private _private_hint",
        "m.py:9 touches DeepSpeed's `ds_tensor`",
        "m.py:10 touches DeepSpeed's `ds_status`",
        "m.py:11 getattrs DeepSpeed's `ds_numel`",
        "m.py:12 touches DeepSpeed's `persistent_parameters`",
        "m.py:13 imports deepspeed.comm by name",
        "m.py:14 replaces a ZeRO-3 param's `all_gather`",
        "m.py:14 replaces a ZeRO-3 param's `partition`",
    ]


def test_the_deepspeed_check_passes_type_hints_and_other_packages() -> None:
    source = """
from typing import TYPE_CHECKING
import torch
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
if TYPE_CHECKING:
    import deepspeed
def f(engine: deepspeed.DeepSpeedEngine) -> None:
    return remove_module_hooks(engine.module)
"""
    assert deepspeed_violations(source) == []


# ---------------------------------------------------------------------------------------------- the surface


def _documented_surface() -> dict[str, set[str]]:
    """``{module: names}`` from the bullets of ``zero/__init__.py``'s docstring: ``- ``module``: ``name``, ...``."""
    doc = lightning_frozen.zero.__doc__ or ""
    surface: dict[str, set[str]] = {}
    for bullet in re.split(r"\n- ", doc)[1:]:
        module, *names = re.findall(r"``([A-Za-z_][\w]*)``", bullet)
        surface[module] = set(names)
    return surface


def _used_from_zero(path: Path) -> set[tuple[str, str]]:
    """``(module, name)`` for each name of a ``zero/`` module that the module at ``path`` imports or uses."""
    tree = ast.parse(path.read_text())
    used: set[tuple[str, str]] = set()
    aliases: dict[str, str] = {}  # local name -> zero module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_frozen.zero":
            aliases.update({alias.asname or alias.name: alias.name for alias in node.names})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_frozen.zero."):
            module = (node.module or "").removeprefix("lightning_frozen.zero.")
            used.update((module, alias.name) for alias in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.add((aliases[node.value.id], node.attr))
    return used


def _defined_in(module: str) -> set[str]:
    """The names ``zero/<module>.py`` defines at its top level (not those it imports)."""
    tree = ast.parse((SEAM / f"{module}.py").read_text())
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def test_the_zero_surface_is_documented_and_defined() -> None:
    surface = _documented_surface()
    used = {pair for path in OUTSIDE_SEAM for pair in _used_from_zero(path)}
    assert sorted(f"{m}.{n}" for m, n in used if n not in surface.get(m, set())) == []
    # every documented name is the module's own: nothing passes through the seam from elsewhere
    assert sorted(f"{m}.{n}" for m, names in surface.items() for n in names if n not in _defined_in(m)) == []
    assert "DeepSpeed 0.19" in (lightning_frozen.zero.__doc__ or "")
