"""What a run leaves behind: snapshots of a user's modules and of the classes and modules of the libraries the package
touches, taken before and after a run and compared (``tests/test_run_ledger.py``).

A snapshot records identities, not values: which instance attributes, hooks and parameter attributes each of the
user's modules has, which function, method or class each name of a library's module or class is bound to, and which
object each other global of a library's module or of the package's holds (DeepSpeed's accelerator, transformers'
``HfDeepSpeedConfig`` reference), with the length of the package's own tables. A patch left in place shows as a
changed binding; an attribute or hook left on a layer shows as a name that was not there; an object a run set and did
not put back, or a table of the package's that a run filled and left filled, as a changed global.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

# whose classes and module-level functions a run may patch while it runs
LIBRARIES = ("torch", "lightning", "deepspeed", "transformers", "peft")
PACKAGE = "lightning_frozen"
# globals a run changes and leaves on purpose, and why
KEPT_GLOBALS = {
    "deepspeed.comm.comm:cdb": "the process group the first run starts serves the process's later runs",
    "deepspeed.utils.groups:_WORLD_GROUP": "the process group the first run starts serves the process's later runs",
    "transformers.integrations.hub_kernels:_KERNEL_MAPPING_CACHE": "transformers' cache, made at a model's first use",
    # per param, held weakly, for as long as it holds codes (the next run gathers them); `unshard` forgets it
    "lightning_frozen.zero.frozen_storage:_stored_as": "which codes each quantized param's shard holds",
    "lightning_frozen.zero.gathers:_deepspeed": "DeepSpeed's own gather methods of each quantized param",
    "lightning_frozen.zero.gathers:_kind": "which gather methods each quantized param has",
    # per param, held weakly, for as long as its shard lies in a mapped file (the code cache's, /dev/shm's)
    "lightning_frozen.zero.frozen_files:_spans": "where each param's rows lie in its mapped file",
    "lightning_frozen.zero.frozen_files:_rows": "every rank's row of each param whose rows all lie in one file",
    "lightning_frozen.zero.frozen_files:_counted": "the finalizers that take a shared row off the count",
    # per module, held weakly, for as long as it keeps its shards; `unshard` takes the attributes off and forgets it
    "lightning_frozen.zero.whole:_added_by_engine": "which attributes building an engine added to each module",
}
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_MODULE_ATTRIBUTES = {"_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"}


def _bound(value: Any) -> bool:
    """A binding a patch would change: functions, methods, descriptors wrapping them, and classes."""
    return isinstance(
        value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, property, staticmethod, classmethod)
    ) or inspect.isclass(value)


def _namespaces(packages: Iterable[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(module name, its globals)`` for each loaded module of ``packages``."""
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in packages:
            continue
        try:
            yield module_name, dict(vars(module))
        except TypeError:
            continue


def _library_bindings(libraries: Iterable[str]) -> dict[str, int]:
    """``{"module:name" or "module:Class.name": id(value)}`` over the loaded modules of ``libraries``."""
    seen: dict[str, int] = {}
    for module_name, namespace in _namespaces(libraries):
        for name, value in namespace.items():
            if _bound(value):
                seen[f"{module_name}:{name}"] = id(value)
            if inspect.isclass(value) and getattr(value, "__module__", None) == module_name:
                for attribute, member in list(vars(value).items()):
                    if _bound(member):
                        seen[f"{module_name}:{name}.{attribute}"] = id(member)
    return seen


def _object_globals(packages: Iterable[str]) -> dict[str, tuple[int, Any]]:
    """``{"module:name": (id(value), its length or None)}`` for each global of the loaded modules of ``packages`` that
    holds an object rather than a function, class, module or constant; the length only of the package's own (the
    libraries' caches grow as they are used)."""
    seen: dict[str, tuple[int, Any]] = {}
    for module_name, namespace in _namespaces(packages):
        for name, value in namespace.items():
            if name.startswith("__") or _bound(value) or isinstance(value, (types.ModuleType, *_CONSTANTS)):
                continue
            length = None
            if module_name.split(".")[0] == PACKAGE and isinstance(value, Sized) and not isinstance(value, Tensor):
                length = len(value)
            seen[f"{module_name}:{name}"] = (id(value), length)
    return seen


_CONSTANTS = (int, float, complex, str, bytes, bool, tuple, frozenset, type(...))


def _module_traces(model: nn.Module) -> dict[str, Any]:
    """Per submodule: its instance attributes (other than torch's own), hook counts and each param's attributes."""
    traces: dict[str, Any] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        own = {key for key in vars(module) if key not in _MODULE_ATTRIBUTES and not key.startswith("_")}
        own |= {key for key in vars(module) if key.startswith("_") and key not in _HOOK_DICTS and not _torch_own(key)}
        traces[f"{name}:attributes"] = sorted(own)
        traces[f"{name}:hooks"] = {hooks: len(getattr(module, hooks, {})) for hooks in _HOOK_DICTS}
        for param_name, param in module.named_parameters(recurse=False):
            traces[f"{name}.{param_name}:param"] = (sorted(vars(param)), type(param).__name__)
    return traces


_TORCH_MODULE_FIELDS = set(vars(nn.Module()))


def _torch_own(key: str) -> bool:
    return key in _TORCH_MODULE_FIELDS


@dataclass
class Snapshot:
    """The user's modules and the libraries' bindings at one moment."""

    modules: dict[str, Any]
    bindings: dict[str, int]
    libraries: tuple[str, ...] = field(default=LIBRARIES)
    hooked_steps: set[str] = field(default_factory=set)
    objects: dict[str, tuple[int, Any]] = field(default_factory=dict)

    @classmethod
    def take(cls, *models: nn.Module, libraries: tuple[str, ...] = LIBRARIES) -> Snapshot:
        # DeepSpeed's Muon, decorated with torch.compile, is imported by the first engine's optimizer check, and its
        # import makes torch's dynamo wrap torch.jit.trace and every optimizer's _init_group for good
        # (TorchPatcher.patch): imported before any snapshot, so that torch's own doing is not taken for a run's
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

        modules = {
            f"{i}/{key}": value for i, model in enumerate(models) for key, value in _module_traces(model).items()
        }
        objects = _object_globals((*libraries, PACKAGE))
        return cls(modules, _library_bindings(libraries), libraries, _hooked_steps(), objects)

    def changes_since(self, before: Snapshot) -> list[str]:
        """What differs: each changed or added module trace, and each library binding that changed or was added to a
        name space that existed before (modules imported during the run bring new names; those are not changes)."""
        changes = [
            f"{key}: {before.modules.get(key)!r} -> {value!r}"
            for key, value in self.modules.items()
            if before.modules.get(key) != value
        ]
        changes += [f"{key} missing after the run" for key in before.modules if key not in self.modules]
        spaces = {
            key.rsplit(".", 1)[0] if "." in key.split(":", 1)[1] else key.split(":")[0] for key in before.bindings
        }
        for key, identity in self.bindings.items():
            if key in self.hooked_steps:
                continue  # torch wraps an optimizer class's `step` for its hooks at its first instance, for good
            if key in before.bindings:
                if before.bindings[key] != identity:
                    changes.append(f"{key} rebound")
            elif (key.rsplit(".", 1)[0] if "." in key.split(":", 1)[1] else None) in spaces:
                changes.append(f"{key} added")
        changes += [f"{key} removed" for key in before.bindings if key not in self.bindings and _still_loaded(key)]
        changes += [
            f"{key}: {before.objects[key]} -> {value} (object id, length)"
            for key, value in self.objects.items()
            if key in before.objects and before.objects[key] != value and key not in KEPT_GLOBALS
        ]
        return changes


def _hooked_steps() -> set[str]:
    from torch.optim import Optimizer

    hooked = set()
    for cls in _subclasses(Optimizer):
        if getattr(vars(cls).get("step"), "hooked", False):
            hooked.add(f"{cls.__module__}:{cls.__qualname__}.step")
    return hooked


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def _still_loaded(key: str) -> bool:
    return key.split(":")[0] in sys.modules


def package_traces(model: nn.Module, package: str = "lightning_frozen") -> list[str]:
    """What of ``package`` is on ``model``'s modules and params: attributes named after it (``lf_``...), instance
    ``forward``s and hooks whose function it defines."""
    found = []
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key.startswith("lf_") or "lightning_frozen" in key or _defined_in(value, package):
                found.append(f"{name or '<root>'}.{key}")
        for hooks in _HOOK_DICTS:
            for hook in getattr(module, hooks, {}).values():
                if _defined_in(hook, package):
                    found.append(f"{name or '<root>'} {hooks}: {hook!r}")
        for param_name, param in module.named_parameters(recurse=False):
            for key in vars(param):
                # by name only: a quantized shard keeps the package's gather, the one that decodes it (README)
                if key.startswith("lf_") or "lightning_frozen" in key:
                    found.append(f"{name}.{param_name}.{key}")
    return found


def _defined_in(value: Any, package: str) -> bool:
    """Whether ``value`` is a function (or a method, or a partial of one) that ``package`` defines, or an object of a
    class it defines (a callable wrapper: ``functools.update_wrapper`` gives it the wrapped function's ``__module__``,
    so its class is asked)."""
    if type(value).__module__.startswith(package):
        return True
    function = getattr(getattr(value, "func", value), "__func__", getattr(value, "func", value))
    return isinstance(function, types.FunctionType) and (function.__module__ or "").startswith(package)
