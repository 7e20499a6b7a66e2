"""The private names of other packages the package relies on, as values: what each one is, how to tell that an
installed release still has it, how to say that it moved, and the capability (the core, or an optional part) that
needs it.

A row names where the name is, the parameters the package passes or receives where a call depends on them, and the
attributes a function must still set or read. ``capabilities.py`` holds the one table of rows, by capability, and
checks them.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import pkgutil
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_frozen.errors import format_names

# the releases the package was written for and its tests run on; pyproject's lower bounds (tests/test_dependencies.py)
WRITTEN_FOR = dict(torch="2.13", lightning="2.6.6", deepspeed="0.19.8", peft="0.21.2", transformers="5.25")


@dataclass(frozen=True)
class ForeignName:
    """A name of another package that the package overrides, calls or reads, and what the package relies on about it.

    ``target``: ``"module:Class.attribute"``, as ``pkgutil.resolve_name`` reads it; its first module is the package.
    ``params``: the parameters the package passes, in order (any later one must have a default); with ``exact``, the
    package overrides or replaces the function, so its callers pass exactly these. ``in_code``: attributes the
    function must still set or read (on instances, where no class attribute shows them), looked for in its code.
    """

    target: str
    used_in: str
    params: Optional[tuple[str, ...]] = None
    exact: bool = False
    in_code: tuple[str, ...] = ()

    @property
    def package(self) -> str:
        return self.target.split(".")[0].split(":")[0]

    @property
    def dotted(self) -> str:
        return self.target.replace(":", ".")


@dataclass(frozen=True, eq=False)  # one object per capability: looked up by identity, cheaply, where it is used
class Capability:
    """A part of the package that needs private names of other packages: the core, which every run needs, or an
    optional capability, which a run may do without.

    ``rows``: the names it needs. ``fallback``: what a run does while they moved (the capability is off); empty for
    the core. ``changes``: what it changes in the process while on, entered in the run's ledger, and where.
    ``asked``: whether a strategy's resolved spec asks for it by argument (then a moved name raises when the strategy
    is built); None where no argument does.
    """

    name: str
    rows: tuple[ForeignName, ...]
    fallback: str
    changes: str = ""
    asked: Optional[Callable[[Any], bool]] = None


def installed_version(package: str) -> Optional[str]:
    """The installed version of ``package`` (a distribution name), or None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def problem_of(row: ForeignName) -> Optional[str]:
    """What is wrong with ``row``'s name in the installed package (``"is gone"``, another signature, an attribute no
    longer in its code), or None where it is as the package was written for."""
    try:
        found = pkgutil.resolve_name(row.target)
    except (ImportError, AttributeError):
        return "is gone"
    if row.params is not None and (wrong := _signature_problem(found, row.params, row.exact)):
        return wrong
    missing = [name for name in row.in_code if name not in _code_names(found)]
    return f"no longer sets or reads {format_names(missing)}" if missing else None


def _signature_problem(function: Any, params: tuple[str, ...], exact: bool) -> Optional[str]:
    try:
        found = list(inspect.signature(_innermost(function)).parameters.values())
    except (TypeError, ValueError):
        return "has no signature to check"
    names = tuple(p.name for p in found)
    later = found[len(params) :]
    optional = all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in later)
    fits = names == params if exact else names[: len(params)] == params and optional
    return None if fits else f"takes ({', '.join(names)}), not ({', '.join(params)})"


_DYNAMO = "torch._dynamo."  # the wrappers torch.compile installs on torch's own functions come from here


def _innermost(function: Any) -> Any:
    """``function`` without its decorators: ``__wrapped__``, or the one function in the closure of a ``(*args,
    **kwargs)`` wrapper (DeepSpeed's ``instrument_w_nvtx`` wraps without ``functools.wraps``) or of torch's dynamo's
    ``(self, *args, **kwargs)`` one (its ``patched_init`` of ``Module.__init__``, once anything was compiled)."""
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    dynamos = code is not None and code.co_argcount == 1 and getattr(function, "__module__", "").startswith(_DYNAMO)
    if code is None or (code.co_argcount and not dynamos) or code.co_kwonlyargcount:
        return function
    inner = [value for value in _closure(function) if callable(value) and hasattr(value, "__code__")]
    return _innermost(inner[0]) if len(inner) == 1 else function


def _closure(function: Any) -> Iterator[Any]:
    for cell in function.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue


def _code_names(function: Any) -> set[str]:
    """Every attribute, global and string constant in the code of ``function`` and of the functions defined in it."""
    names: set[str] = set()
    pending = [getattr(_innermost(function), "__code__", None)]
    while pending:
        code = pending.pop()
        if code is None:
            continue
        names.update(code.co_names)
        names.update(value for value in code.co_consts if isinstance(value, str))
        pending.extend(value for value in code.co_consts if isinstance(value, types.CodeType))
    return names


def written_for() -> str:
    """The releases the package was written for, for a message."""
    return ", ".join(f"{package} {version}" for package, version in WRITTEN_FOR.items())


def moved_message(row: ForeignName, problem: str) -> str:
    """One line on a moved name: the package and its installed version, the name, what is wrong, where it is used."""
    return f"{row.package} {installed_version(row.package)}: `{row.dotted}` {problem} (used in {row.used_in})"


def off_warning(capability: Capability, moved: list[tuple[ForeignName, str]]) -> str:
    """The warning for an optional capability turned off because names of its moved: which, and what runs instead."""
    names = "; ".join(moved_message(row, problem) for row, problem in moved)
    return (
        f"lightning-frozen: {capability.name} is off, because {names}; so {capability.fallback}. lightning-frozen was"
        f" written for {written_for()}."
    )


@contextmanager
def reaching(capability: Capability) -> Iterator[None]:
    """Run the block, a teardown's reach into a name of ``capability``; where that name moved since the run started
    (``AttributeError``, ``KeyError``, ``ImportError``), skip the rest of the block with a warning that names it and
    what that leaves behind: a teardown that raised would hide the error that ended the run."""
    try:
        yield
    except (AttributeError, KeyError, ImportError) as moved:
        rank_zero_warn(
            f"lightning-frozen: a name of {capability.name} moved ({type(moved).__name__}: {moved}), so"
            f" {capability.fallback}. lightning-frozen was written for {written_for()}."
        )


def drift_message(moved: list[tuple[ForeignName, str]]) -> str:
    """The message of :class:`~lightning_frozen.errors.DependencyDriftError` for the required names that moved."""
    lines = "\n".join(f"- {moved_message(row, problem)}" for row, problem in moved)
    pins = " ".join(sorted({f'"{row.package}=={WRITTEN_FOR[row.package]}.*"' for row, _ in moved}))
    return (
        f"lightning-frozen relies on private names of the packages it extends, and the installed releases moved"
        f" {len(moved)} of them:\n{lines}\nlightning-frozen was written for {written_for()}. Install those"
        f" (`pip install {pins}`), or a lightning-frozen release written for the ones installed."
    )
