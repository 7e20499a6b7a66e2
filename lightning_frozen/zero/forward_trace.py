"""ZeRO-3's trace reset once per outermost call of the engine's module, so that ``self(x)`` in a step prefetches.

A step runs inside the engine's call of the LightningModule, so a ``self(x)`` in it runs DeepSpeed's start-of-forward
hook (the coordinator's ``reset_step``) a second time mid-step: the trace recorded so far (the root alone) is taken
as complete, the next submodule invalidates it, and ZeRO-3 never prefetches. Here the hook runs only for the
outermost call; :func:`restore_trace_reset` puts DeepSpeed's back (the rows of ``capabilities.TRACE``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.hooks import RemovableHandle


class _OutermostCall:
    """DeepSpeed's start-of-forward hook, run only when the module is not already inside its own call."""

    def __init__(self, offload: Any, start_of_forward: Callable[..., Any]) -> None:
        self.offload = offload
        self.start_of_forward = start_of_forward
        self.depth = 0
        self.leave_handle: Optional[RemovableHandle] = None

    def enter(self, module: nn.Module, args: tuple) -> None:
        if self.depth == 0:
            self.start_of_forward(module, args)
        self.depth += 1

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.depth -= 1

    def restore(self, module: nn.Module) -> None:
        """Put DeepSpeed's hook back where it was, first among the module's pre-forward hooks."""
        self.offload.fwd_pre_hook.remove()
        if self.leave_handle is not None:
            self.leave_handle.remove()
            if self.leave_handle in self.offload.forward_hooks:
                self.offload.forward_hooks.remove(self.leave_handle)
        self.offload.fwd_pre_hook = module.register_forward_pre_hook(self.start_of_forward, prepend=True)


def reset_trace_at_outermost_call(module: nn.Module, offload: Any) -> bool:
    """Make ``offload``'s (DeepSpeed's ``DeepSpeedZeRoOffload``) start-of-forward hook on ``module`` run only at the
    outermost call of ``module``; returns whether it was replaced (not where the hook is not found on ``module``: then
    a warning says that a step calling ``self(...)`` will not prefetch)."""
    handle = getattr(offload, "fwd_pre_hook", None)
    start_of_forward = module._forward_pre_hooks.get(handle.id) if isinstance(handle, RemovableHandle) else None
    if start_of_forward is None:
        rank_zero_warn(
            "lightning-frozen: DeepSpeed's start-of-forward hook is not on the module, so it is left alone: a step that"
            " calls `self(...)` resets ZeRO-3's trace and nothing is prefetched. Call the submodules instead"
            " (`self.model(x)`)."
        )
        return False
    outermost = _OutermostCall(offload, start_of_forward)
    handle.remove()
    # first, as DeepSpeed registered it: the trace is reset before the root module's own fetch hook records it
    offload.fwd_pre_hook = module.register_forward_pre_hook(outermost.enter, prepend=True)
    # also after a forward that raised; listed with DeepSpeed's forward hooks, so destroying the engine removes it
    outermost.leave_handle = module.register_forward_hook(outermost.leave, always_call=True)
    offload.forward_hooks.append(outermost.leave_handle)
    return True


def restore_trace_reset(module: nn.Module) -> None:
    """Undo :func:`reset_trace_at_outermost_call` on ``module``: DeepSpeed's start-of-forward hook runs at every call
    again. Nothing happens where it was not replaced (or the engine was destroyed)."""
    for hook in list(module._forward_pre_hooks.values()):
        outermost = getattr(hook, "__self__", None)
        if isinstance(outermost, _OutermostCall):
            outermost.restore(module)
