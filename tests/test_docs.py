"""README.md and the pages under docs/ point only at what exists (issue 26, item 5).

Each checker is a function over one page's text that returns ``page:line: problem`` messages; each is shown to fail
on a small example. The module map of docs/internals.md is checked both ways: every line names a file that exists,
and every module of the package has a line.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INTERNALS = ROOT / "docs" / "internals.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
NOT_THE_PROJECT = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}
# files of the reader's own that the pages' commands name (`python train.py`)
USER_FILES = {"train.py"}
# files of the project's workspace that are not in the repository, which a page must not cite
OUTSIDE_FILES = ("DESIGN.md", "STYLE.md", "shared/")
# how a README sentence speaks of the machines it ran on instead of the project; beside a figure, name the machine
MACHINE_TALK = re.compile(r"\bthis (?:machine|CPU|project's machines?)\b|\b(?:seen|measured|run|checked) here\b", re.I)

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
# `lightning_frozen/zero/engine.py`, `benchmarks/results/`, `zero/engine.py`, `strategy.py`
FILE_PATH = re.compile(r"(?<![\w./~*<>-])((?:[\w.-]+/)*[\w-]+\.(?:py|c|md|sh|yaml|json|png))(?![\w/])")
FOLDER_PATH = re.compile(r"(?<![\w./~*<>-])((?:[\w.-]+/)+)(?![\w.*<])")
DOTTED = re.compile(r"(?<![\w.])lightning_frozen((?:\.\w+)+)")
FROM_IMPORT = re.compile(r"\bfrom (lightning_frozen(?:\.\w+)*) import \(?([\w, ]+)")
MAP_ENTRY = re.compile(r"^( *)([\w.]+(?:\.py|\.c|/))(?:\s{2,}|$)")


def _relative(path: Path, root: Path = ROOT) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _blanked(text: str, pattern: re.Pattern[str]) -> str:
    """``text`` with each match of ``pattern`` turned into spaces, newlines kept, so offsets and lines still hold."""
    return pattern.sub(lambda match: re.sub(r"[^\n]", " ", match.group()), text)


def _module_map_block(text: str) -> re.Match[str] | None:
    return next((block for block in FENCE.finditer(text) if block.group().split("\n")[1] == "lightning_frozen/"), None)


def heading_anchors(text: str) -> set[str]:
    """The ``#anchor`` of each heading outside code blocks, as GitHub makes it (lower case, punctuation dropped, spaces
    as hyphens)."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", _blanked(text, FENCE), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def broken_links(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """``page:line: ...`` for each relative link in ``text`` that leaves the repository, names no file, or names an
    ``#anchor`` its page has no heading for. Links inside code are not links."""
    problems = []
    for match in LINK.finditer(_blanked(_blanked(text, FENCE), INLINE_CODE)):
        target = match.group(1)
        if URL.match(target) or target.startswith("mailto:"):
            continue
        where = f"{_relative(page, root)}:{_line(text, match.start())}: link {target!r}"
        name, _, anchor = target.partition("#")
        linked = (page.parent / name).resolve()
        if not name:
            if anchor not in heading_anchors(text):
                problems.append(f"{where}: {_relative(page, root)} has no heading with the anchor #{anchor}")
        elif not linked.is_relative_to(root):
            problems.append(f"{where} leads outside the repository")
        elif not linked.exists():
            problems.append(f"{where}: {_relative(linked, root)} does not exist")
        elif anchor and anchor not in heading_anchors(linked.read_text()):
            problems.append(f"{where}: {_relative(linked, root)} has no heading with the anchor #{anchor}")
    return problems


def _top_level_names(module: Path) -> set[str]:
    """The names a module binds at its top level: functions, classes, assignments and imports."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def dotted_name_problem(dotted: str, root: Path = ROOT) -> str | None:
    """Why ``dotted`` (``lightning_frozen.base.codec``, ``lightning_frozen.load_adapter``) names nothing of the
    package, or None: each part is a subpackage, a module, or then a name that module defines or imports."""
    folder: Path | None = root / "lightning_frozen"
    module = root / "lightning_frozen" / "__init__.py"
    for part in dotted.split(".")[1:]:
        if folder is not None and (folder / part / "__init__.py").is_file():
            folder, module = folder / part, folder / part / "__init__.py"
        elif folder is not None and (folder / f"{part}.py").is_file():
            folder, module = None, folder / f"{part}.py"
        elif part in _top_level_names(module):
            return None
        else:
            missing = f" and {_relative(folder / part, root)}.py does not exist" if folder is not None else ""
            return f"{_relative(module, root)} defines no {part!r}{missing}"
    return None


def _path_mentions(text: str) -> Iterator[tuple[int, str]]:
    """Each file or folder path ``text`` mentions, with its offset, outside URLs and outside the module map."""
    searched = _blanked(text, URL)
    block = _module_map_block(searched)
    if block is not None:
        searched = searched[: block.start()] + _blanked(block.group(), re.compile(r".+")) + searched[block.end() :]
    found = (match for pattern in (FILE_PATH, FOLDER_PATH) for match in pattern.finditer(searched))
    yield from sorted((match.start(1), match.group(1)) for match in found)


def missing_paths(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """``page:line: ...`` for each path or dotted name of the project that ``text`` mentions and that does not exist.

    A path whose first part is an entry of the repository root (``benchmarks/run.py``, ``lightning_frozen/...``) is
    taken from the root; a module path of another form (``zero/engine.py``, ``strategy.py``: ``.py`` or ``.c``) from
    the package folder, as the module map writes them. Dotted names (``lightning_frozen.adapters``) and ``from
    lightning_frozen... import`` name a subpackage, a module or a name it defines.
    """
    problems, package = [], root / "lightning_frozen"
    top_level = {path.name for path in root.iterdir()} - NOT_THE_PROJECT
    for offset, mention in _path_mentions(text):
        where = f"{_relative(page, root)}:{_line(text, offset)}: {mention!r}"
        if mention.split("/")[0] in top_level:
            if not (root / mention).exists():
                problems.append(f"{where} names {mention}, which does not exist")
        elif mention.endswith((".py", ".c")) and mention not in USER_FILES and not (package / mention).exists():
            problems.append(f"{where} names the module {_relative(package / mention, root)}, which does not exist")
    for match in DOTTED.finditer(_blanked(text, URL)):
        if problem := dotted_name_problem(match.group(), root):
            problems.append(f"{_relative(page, root)}:{_line(text, match.start())}: {match.group()!r}: {problem}")
    for match in FROM_IMPORT.finditer(text):
        for name in (name.strip() for name in match.group(2).split(",")):
            dotted = f"{match.group(1)}.{name.split(' as ')[0].strip()}"
            if name and (problem := dotted_name_problem(dotted, root)):
                problems.append(f"{_relative(page, root)}:{_line(text, match.start())}: {dotted!r}: {problem}")
    return problems


def module_map_problems(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """``page:line: ...`` for each module map line naming a file or folder the package lacks, and ``page: ...`` for
    each module of the package (``.py`` or ``.c``; a subpackage's ``__init__.py`` is its folder's line) with no line.
    """
    block, package, shown = _module_map_block(text), root / "lightning_frozen", _relative(page, root)
    if block is None:
        return [f"{shown}: no module map (a code block whose first line is 'lightning_frozen/')"]
    problems, mapped, folders = [], set(), [package]
    first_line = _line(text, block.start())
    for number, line in enumerate(block.group().split("\n")[2:-1], start=first_line + 2):
        entry = MAP_ENTRY.match(line)
        if entry is None:
            continue  # a description carried over from the line above
        depth, name = len(entry.group(1)) // 2, entry.group(2)
        path = folders[: depth or 1][-1] / name if depth <= len(folders) else None
        if path is None:
            problems.append(f"{shown}:{number}: {name!r} is indented below no folder of the map")
            continue
        del folders[depth:]
        mapped.add(path)
        if name.endswith("/"):
            folders.append(path)
            mapped.add(path / "__init__.py")
        if not (path.is_dir() if name.endswith("/") else path.is_file()):
            problems.append(f"{shown}:{number}: the module map names {_relative(path, root)}, which does not exist")
    modules = sorted(p for p in package.rglob("*") if p.suffix in (".py", ".c") and "__pycache__" not in p.parts)
    problems += [f"{shown}: {_relative(p, root)} has no line in the module map" for p in modules if p not in mapped]
    return problems


def cites_outside_the_repository(page: Path, text: str) -> list[str]:
    """``page:line: ...`` for each mention of a workspace file that is not in the repository, or of ``../`` (a path
    above the repository root) in README.md."""
    cited = [*OUTSIDE_FILES, *(["../"] if page == README else [])]
    return [
        f"{_relative(page)}:{_line(text, match.start())}: cites {match.group()!r}, which is not in the repository"
        for match in re.finditer("|".join(map(re.escape, cited)), text)
    ]


def machine_talk(page: Path, text: str) -> list[str]:
    """``page:line: ...`` for each phrase that speaks of the machine the page was written on ("this machine", "seen
    here"): README.md speaks of the project, and names a machine only beside a figure."""
    return [
        f"{_relative(page)}:{_line(text, match.start())}: {match.group()!r}: say which machine, beside its figure"
        for match in MACHINE_TALK.finditer(text)
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: _relative(page))
def test_every_relative_link_resolves(page: Path) -> None:
    problems = broken_links(page, page.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: _relative(page))
def test_every_path_and_dotted_name_of_the_project_exists(page: Path) -> None:
    problems = missing_paths(page, page.read_text())
    assert not problems, "\n".join(problems)


def test_the_module_map_names_every_module_and_only_modules_that_exist() -> None:
    problems = module_map_problems(INTERNALS, INTERNALS.read_text())
    assert not problems, "\n".join([*problems, "update docs/internals.md's module map"])


@pytest.mark.parametrize("page", PAGES, ids=lambda page: _relative(page))
def test_no_page_cites_a_file_outside_the_repository(page: Path) -> None:
    problems = cites_outside_the_repository(page, page.read_text())
    assert not problems, "\n".join(problems)


def test_the_readme_speaks_of_the_project_not_of_a_machine() -> None:
    problems = machine_talk(README, README.read_text())
    assert not problems, "\n".join(problems)


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    """A repository of a few files, so that the checkers' own tests do not follow the real tree as it changes."""
    files = {
        "README.md": "# Tiny\n",
        "docs/memory.md": "# Memory\n\n## Host memory on the CPU\n",
        "benchmarks/results/results.png": "",
        "examples/two_process/run.py": "",
        "lightning_frozen/__init__.py": "from lightning_frozen.loading import load_adapter\n",
        "lightning_frozen/adapters.py": "",
        "lightning_frozen/loading.py": "def load_adapter():\n    pass\n",
        "lightning_frozen/strategy.py": "",
        "lightning_frozen/preemption.py": "",
        "lightning_frozen/zero/__init__.py": "",
        "lightning_frozen/zero/engine.py": "",
        "lightning_frozen/zero/params.py": "",
        "lightning_frozen/optim/__init__.py": "",
        "lightning_frozen/optim/schedulers.py": "def register_per_group_attributes():\n    pass\n",
        "lightning_frozen/base/__init__.py": "",
        "lightning_frozen/base/codec_kernels.c": "",
    }
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    return tmp_path


def test_the_link_checker_names_the_page_line_and_link(tiny_repo: Path) -> None:
    text = (
        "# Example\n\n## A heading, with `code`\n"
        "[ok](memory.md) [ok](#a-heading-with-code) ![ok](../benchmarks/results/results.png) [web](https://x.org/a)\n"
        "[gone](nope.md)\n"
        "[anchor](memory.md#no-such-heading) [up](../../outside.md) [ok](memory.md#host-memory-on-the-cpu)\n"
        "`[in code](nope.md)`\n```\n[in a block](nope.md)\n# not a heading\n```\n[self](#not-a-heading)\n"
    )
    assert broken_links(tiny_repo / "docs" / "example.md", text, tiny_repo) == [
        "docs/example.md:5: link 'nope.md': docs/nope.md does not exist",
        "docs/example.md:6: link 'memory.md#no-such-heading': docs/memory.md has no heading with the anchor "
        "#no-such-heading",
        "docs/example.md:6: link '../../outside.md' leads outside the repository",
        "docs/example.md:12: link '#not-a-heading': docs/example.md has no heading with the anchor #not-a-heading",
    ]
    assert heading_anchors("## Prefetching when `training_step` calls `self(x)`\n") == {
        "prefetching-when-training_step-calls-selfx"
    }


def test_the_path_checker_names_each_missing_module_path_and_dotted_name(tiny_repo: Path) -> None:
    text = (
        "`lightning_frozen/zero/engine.py` (zero/params.py), `strategy.py`, `examples/two_process/`, `train.py`, see\n"
        "`lightning_frozen/format/codec.py` and (format/layout.py), `hf/reference.py`, `benchmarks/nope/`\n"
        "`lightning_frozen.adapters`, `lightning_frozen.load_adapter`, `lightning_frozen.optim.schedulers.register_"
        "per_group_attributes`\n"
        "`lightning_frozen.base.codec`, `lightning_frozen.nothing` and https://x.org/lightning_frozen/nope.py\n"
        "```python\nfrom lightning_frozen import adapters as multi, nope\n"
        "from lightning_frozen.zero import engine\n```\n"
        "adapter_config.json, `config.yaml`, `~/.cache/torch_extensions/*/deepspeed_shm_comm/lock`, `path/to/x.json`\n"
    )
    assert missing_paths(tiny_repo / "README.md", text, tiny_repo) == [
        "README.md:2: 'lightning_frozen/format/codec.py' names lightning_frozen/format/codec.py, which does not exist",
        "README.md:2: 'format/layout.py' names the module lightning_frozen/format/layout.py, which does not exist",
        "README.md:2: 'hf/reference.py' names the module lightning_frozen/hf/reference.py, which does not exist",
        "README.md:2: 'benchmarks/nope/' names benchmarks/nope/, which does not exist",
        "README.md:4: 'lightning_frozen.base.codec': lightning_frozen/base/__init__.py defines no 'codec' and "
        "lightning_frozen/base/codec.py does not exist",
        "README.md:4: 'lightning_frozen.nothing': lightning_frozen/__init__.py defines no 'nothing' and "
        "lightning_frozen/nothing.py does not exist",
        "README.md:6: 'lightning_frozen.nope': lightning_frozen/__init__.py defines no 'nope' and "
        "lightning_frozen/nope.py does not exist",
    ]


def test_the_module_map_check_names_stale_lines_and_unmapped_modules(tiny_repo: Path) -> None:
    text = (
        "# Internals\n\n```\nlightning_frozen/\n"
        "  __init__.py         public names\n"
        "  strategy.py         the strategy: a description\n"
        "                      carried over to a second line.py/\n"
        "  zero/               the DeepSpeed seam\n"
        "    engine.py         the engine\n"
        "    gone.py           moved away\n"
        "  format/             a folder not there yet\n"
        "      deep.py         indented below no folder\n"
        "  adapters.py         several adapters\n"
        "```\n"
    )
    assert module_map_problems(tiny_repo / "docs" / "internals.md", text, tiny_repo) == [
        "docs/internals.md:10: the module map names lightning_frozen/zero/gone.py, which does not exist",
        "docs/internals.md:11: the module map names lightning_frozen/format, which does not exist",
        "docs/internals.md:12: 'deep.py' is indented below no folder of the map",
        "docs/internals.md: lightning_frozen/base/__init__.py has no line in the module map",
        "docs/internals.md: lightning_frozen/base/codec_kernels.c has no line in the module map",
        "docs/internals.md: lightning_frozen/loading.py has no line in the module map",
        "docs/internals.md: lightning_frozen/optim/__init__.py has no line in the module map",
        "docs/internals.md: lightning_frozen/optim/schedulers.py has no line in the module map",
        "docs/internals.md: lightning_frozen/preemption.py has no line in the module map",
        "docs/internals.md: lightning_frozen/zero/params.py has no line in the module map",
    ]
    assert module_map_problems(tiny_repo / "docs" / "internals.md", "# Internals\n", tiny_repo) == [
        "docs/internals.md: no module map (a code block whose first line is 'lightning_frozen/')"
    ]


def test_the_outside_and_machine_checks_name_what_they_find() -> None:
    text = "See DESIGN.md and ../shared/STYLE.md.\nMeasured on a 2-core machine: 1.5 s. Seen here, on this machine.\n"
    assert cites_outside_the_repository(README, text) == [
        "README.md:1: cites 'DESIGN.md', which is not in the repository",
        "README.md:1: cites '../', which is not in the repository",
        "README.md:1: cites 'shared/', which is not in the repository",
        "README.md:1: cites 'STYLE.md', which is not in the repository",
    ]
    assert cites_outside_the_repository(INTERNALS, "[README](../README.md)") == []
    assert machine_talk(README, text) == [
        "README.md:2: 'Seen here': say which machine, beside its figure",
        "README.md:2: 'this machine': say which machine, beside its figure",
    ]


def test_the_repository_tracks_no_checkpoint_and_ignores_the_ones_runs_write() -> None:
    """A run's checkpoint stays out of the repository: a stopped benchmark once left a 13.7 MB ``last.ckpt`` in the
    working directory, holding a machine's path as its base reference, and it was committed."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "*.ckpt"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert tracked.stdout.split() == []
    written = ["last.ckpt", "lightning_logs/version_0/checkpoints/epoch=0-step=2.ckpt", ".last.ckpt.lf-1-2-ab.tmp"]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert ignored.stdout.split() == written


def test_the_strategys_init_docstring_is_its_own_and_names_its_arguments() -> None:
    """``help(FrozenAwareDeepSpeedStrategy)`` shows its ``__init__`` docstring: none of Lightning's words that do not
    hold for it, each of its own arguments named, and ``stage=3`` said (issue 63, item 10)."""
    import inspect

    from lightning_frozen import FrozenAwareDeepSpeedStrategy

    doc = " ".join((FrozenAwareDeepSpeedStrategy.__init__.__doc__ or "").split())
    contradicting = ["Defaults have been set to enable ZeRO-Offload", "0 is disabled", "Exclude frozen parameters"]
    assert [phrase for phrase in contradicting if phrase in doc] == []
    parameters = inspect.signature(FrozenAwareDeepSpeedStrategy.__init__).parameters.values()
    own = [p.name for p in parameters if p.kind == p.KEYWORD_ONLY]
    assert len(own) >= 8 and [name for name in own if f"``{name}``" not in doc] == []
    assert "``stage=3``" in doc and "``exclude_frozen_parameters`` and ``load_full_weights`` have no effect" in doc


README_LINES = 250  # issue 63: a page a new user reads through; detail goes to the pages under docs/
SET_UP_COMMANDS = (
    "bash scripts/bootstrap.sh && .venv/bin/python examples/minilm_lora/run.py",
    "bash scripts/bootstrap.sh && .venv/bin/python -m pytest -x -q -n 3",  # the command .ci/run runs
)


def test_the_readme_stays_short_and_gives_the_two_set_up_commands_as_ci_runs_them() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_LINES, f"README.md has {len(text.splitlines())} lines"
    assert [command for command in SET_UP_COMMANDS if f"\n{command}\n" not in text] == []
    assert SET_UP_COMMANDS[1] in (ROOT / ".ci" / "run").read_text()
