"""The package's structure (issue 13): no import cycle between its modules, none hidden behind a function-level
import, and no module reaching into another one's private names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning_frozen

PACKAGE = Path(lightning_frozen.__file__).parent
# dotted names under the package: "strategy", "zero.engine", "zero" (a subpackage's __init__)
MODULES = sorted(
    ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
)


def _source(name: str) -> Path:
    path = PACKAGE.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(tree: ast.Module) -> list[tuple[ast.stmt, list[str], dict[str, str]]]:
    """Each import of a package module: the statement, the modules it imports and the local names bound to them."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_frozen":
            bound = {(a.asname or a.name): a.name for a in node.names if a.name in MODULES}
            found.append((node, list(bound.values()), bound))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_frozen."):
            module = node.module.removeprefix("lightning_frozen.")
            bound = {(a.asname or a.name): f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES}
            found.append((node, list(bound.values()) or [module], bound))
        elif isinstance(node, ast.Import):
            names = [
                a.name.removeprefix("lightning_frozen.") for a in node.names if a.name.startswith("lightning_frozen.")
            ]
            if names:
                found.append((node, names, {}))
    return [item for item in found if item[1]]


def _structure() -> tuple[dict[str, set[str]], list[str]]:
    graph: dict[str, set[str]] = {}
    problems: list[str] = []
    for name in MODULES:
        tree = ast.parse(_source(name).read_text())
        bound: dict[str, str] = {}
        graph[name] = set()
        for node, targets, names in _imports(tree):
            if node.col_offset > 0:
                problems.append(f"{name}.py:{node.lineno} imports {targets} inside a function or block")
            if isinstance(node, ast.ImportFrom):
                problems += [f"{name}.py:{node.lineno} imports `{a.name}`" for a in node.names if a.name[0] == "_"]
            graph[name].update(t for t in targets if t != name)
            bound.update(names)
        for node in ast.walk(tree):
            owner = node.value.id if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) else None
            if owner in bound and node.attr.startswith("_") and not node.attr.startswith("__"):
                problems.append(f"{name}.py:{node.lineno} uses {bound[owner]}.{node.attr}")
    return graph, problems


def _cycle_through(start: str, graph: dict[str, set[str]]) -> list[str]:
    stack = [[start]]
    while stack:
        path = stack.pop()
        for dep in sorted(graph[path[-1]] - {"__init__"}):
            if dep == start:
                return [*path, dep]
            if dep not in path:
                stack.append([*path, dep])
    return []


def test_no_function_level_imports_and_no_private_names_across_modules() -> None:
    _, problems = _structure()
    assert problems == []


def test_no_import_cycle_between_modules() -> None:
    graph, _ = _structure()
    cycles = [" -> ".join(cycle) for name in MODULES if name != "__init__" if (cycle := _cycle_through(name, graph))]
    assert cycles == []
    assert "checkpoint.peft_export" not in graph["checkpoint.file"]


# The floors, lowest first (issue 26). A module may import its own floor and the floors below it, never one above:
# what a lower floor needs from a higher one is handed down as a value or a callable. Within the seams, zero/, hf/
# and the Lightning seam import neither each other nor anything but the ground.
FLOORS: list[tuple[str, list[str]]] = [
    # plain values: the checkpoint layout, the codec, the spec, the rows of other packages' private names; how the
    # process ends (its signal handlers, the files it is writing, dead processes' files)
    ("ground", ["errors", "progress", "format", "spec", "foreign_names", "capabilities", "process"]),
    ("zero seam", ["zero"]),  # DeepSpeed
    ("hf seam", ["hf"]),  # transformers and PEFT, and the base-reference lookup
    ("lightning seam", ["lightning_seam"]),  # Lightning's private names
    ("domain", ["base", "optim", "adapters", "anatomy", "memory", "arguments"]),
    ("checkpoint", ["checkpoint"]),
    ("lightning face", ["strategy", "finetuning", "preemption", "ledger", "cli", "loops", "generation", "__init__"]),
]
MAY_IMPORT: dict[str, set[str]] = {
    "ground": {"ground"},
    "zero seam": {"ground", "zero seam"},
    "hf seam": {"ground", "hf seam"},
    "lightning seam": {"ground", "lightning seam"},
    "domain": {"ground", "zero seam", "hf seam", "lightning seam", "domain"},
    "checkpoint": {"ground", "zero seam", "hf seam", "lightning seam", "domain", "checkpoint"},
    "lightning face": {floor for floor, _ in FLOORS},
}


def floor_of(module: str) -> str:
    top = module.split(".")[0]
    floors = [floor for floor, members in FLOORS if top in members]
    assert floors, f"lightning_frozen/{module} is on no floor: add its name to FLOORS in tests/test_structure.py"
    return floors[0]


def test_every_import_runs_down_the_floors_or_stays_on_its_own() -> None:
    graph, _ = _structure()
    upward = [
        f"{name} ({floor_of(name)}) imports {target} ({floor_of(target)})"
        for name in MODULES
        for target in sorted(graph[name])
        if floor_of(target) not in MAY_IMPORT[floor_of(name)]
    ]
    assert upward == []


def test_the_floors_test_sees_an_import_that_runs_up() -> None:
    graph, _ = _structure()
    assert "format.layout" in graph["format.codec"] and "zero.params" in graph["base.fingerprint"]  # it reads imports
    assert floor_of("strategy") not in MAY_IMPORT[floor_of("zero.engine")]
    assert floor_of("checkpoint.file") not in MAY_IMPORT[floor_of("base.loaded")]


# The core and the machinery behind its door (issues 39 and 44). The machinery: the quantized gather and the CPU's
# performance stack in zero/compute/ (coded matmuls, node-shared codes, decode buffers, host-memory settings), and the
# compiled kernels of format/native_codec.py with the partial decode only they run. Every other module is the core: it
# reaches the machinery through the door alone, which hands the kernels down as a value; the pure formats, the frozen
# storage and the fingerprint take them as an argument and run tensor ops without them, so they never open the door.
DOOR = "zero.frozen_compute"
MACHINERY = ["zero.compute", "format.native_codec", "format.partial_decode"]
KERNELS_HANDED_IN = ["format", "zero.frozen_storage", "base.fingerprint"]


def _within(module: str, packages: list[str]) -> bool:
    return any(module == package or module.startswith(f"{package}.") for package in packages)


def import_chain(start: str, graph: dict[str, set[str]], targets: list[str], stop: tuple[str, ...] = ()) -> list[str]:
    """The shortest chain of imports from ``start`` to a module within ``targets``, not passing through ``stop``."""
    chains, seen = [[start]], {start}
    while chains:
        chain = chains.pop(0)
        for dep in sorted(graph[chain[-1]] - seen):
            if _within(dep, targets):
                return [*chain, dep]
            seen.add(dep)
            if dep not in stop:
                chains.append([*chain, dep])
    return []


def test_the_core_reaches_the_machinery_only_through_its_door() -> None:
    graph, _ = _structure()
    core = [name for name in MODULES if name != DOOR and not _within(name, MACHINERY)]
    reached = [" -> ".join(chain) for name in core if (chain := import_chain(name, graph, MACHINERY, stop=(DOOR,)))]
    assert reached == []
    takers = [name for name in core if _within(name, KERNELS_HANDED_IN)]
    opened = [" -> ".join(chain) for name in takers if (chain := import_chain(name, graph, [DOOR]))]
    assert takers and opened == []


def test_the_machinery_test_sees_an_import_through_other_modules() -> None:
    graph, _ = _structure()
    assert _within("zero.compute.coded_linear", MACHINERY) and not _within("zero.computed", MACHINERY)
    assert {"zero.compute.quantized", "format.native_codec"} <= graph[DOOR]
    assert import_chain("strategy", graph, MACHINERY) == ["strategy", DOOR, "format.native_codec"]
    assert import_chain("strategy", graph, MACHINERY, stop=(DOOR,)) == []
    # the storage importing the quantized gather, as it once imported the node-shared codes, is seen from the strategy
    reaching = {**graph, "zero.frozen_storage": graph["zero.frozen_storage"] | {"zero.compute.quantized"}}
    chain = import_chain("strategy", reaching, MACHINERY, stop=(DOOR,))
    assert chain[0] == "strategy" and chain[-2:] == ["zero.frozen_storage", "zero.compute.quantized"]
    assert import_chain("base.fingerprint", {**graph, "zero.params": {DOOR}}, [DOOR])[-2:] == ["zero.params", DOOR]


# DeepSpeed attaches these to each ZeRO-3 param; zero/gathers.py alone replaces them and keeps DeepSpeed's own
GATHER_METHODS = {"all_gather", "all_gather_coalesced", "partition"}


def test_one_module_replaces_a_params_gather_methods() -> None:
    found = []
    for name in MODULES:
        for node in ast.walk(ast.parse(_source(name).read_text())):
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if stored and node.attr in GATHER_METHODS and name != "zero.gathers":
                found.append(f"{name}.py:{node.lineno} sets `{node.attr}`")
    assert found == []


def test_no_test_file_imports_or_runs_the_benchmarks() -> None:
    # the benchmarks may use the tests' models; the tests must run without benchmarks/
    found = []
    for path in sorted(set(Path(__file__).parent.rglob("*.py")) - {Path(__file__)}):  # this file names the folder
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [node.value] if isinstance(node, ast.Constant) and node.value == "benchmarks" else []  # a path
            found += [f"{path.name}:{node.lineno} names {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert found == []


# files of other packages the package's comments name (torch's and DeepSpeed's LR scheduler modules)
FOREIGN_FILES = {"lr_scheduler.py", "lr_schedules.py"}


def stale_file_names(text: str, where: str) -> list[str]:
    """The ``*.py`` names in ``text`` that name no file: not a path under the package or the repository, nor the name
    of exactly one package module."""
    root = PACKAGE.parent
    own = [path.relative_to(PACKAGE) for path in PACKAGE.rglob("*.py")]
    stale = []
    for number, line in enumerate(text.splitlines(), 1):
        for name in re.findall(r"(?<![\w./])([\w/]+\.py)\b", line):
            if name in FOREIGN_FILES or (PACKAGE / name).exists() or (root / name).exists():
                continue
            if "/" not in name and sum(path.name == name for path in own) == 1:
                continue
            stale.append(f"{where}:{number}: {name}")
    return stale


def test_docstrings_and_comments_name_files_that_exist() -> None:
    stale = [s for name in MODULES for s in stale_file_names(_source(name).read_text(), f"{name}.py")]
    assert stale == []
    assert stale_file_names("see ``quant.py`` and zero/engine.py", "x") == ["x:1: quant.py"]
