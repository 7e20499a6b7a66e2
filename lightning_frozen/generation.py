"""``generate()`` during a run: the frozen base gathered once per call when it fits the memory budget (the strategy's
``generation_memory``, by default :data:`AUTO_FRACTION` of the free memory, agreed by every rank), else layer by layer
as ZeRO-3 does by itself; a notice on rank 0 says which mode ran, the first time each runs. A run wraps the
``generate`` of each outermost transformers model inside the LightningModule through its ledger, and on several ranks
passes ``synced_gpus=True`` unless the call sets it, since transformers believes ZeRO-3 is on only where the strategy
says so (``hf/transformers_loading.zero3_known``; docs/loops.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_frozen.capabilities import GENERATE, available
from lightning_frozen.hf.generation import generating_models
from lightning_frozen.memory import format_bytes
from lightning_frozen.zero.collectives import gather_objects
from lightning_frozen.zero.gather_once import available_bytes, gathered_once, whole_bytes

# the part of the free memory the default budget allows: the rest holds the KV cache, logits and what the step keeps
AUTO_FRACTION = 0.5
GATHER_ONCE, PER_LAYER = "once per call", "layer by layer"
_OFF = "gathering it once is off (a warning said why when the strategy was built)"


def wrap_generate(ledger: Any, strategy: Any) -> None:
    """Wrap, for this run, the ``generate`` of each outermost transformers model in ``strategy``'s LightningModule,
    once (again after a call wraps nothing); through ``ledger`` (its ``set_attribute``), which puts them back when
    the run ends. ``strategy``: the run's ``FrozenAwareDeepSpeedStrategy``, its engine built (``strategy.model``).
    Where ``capabilities.GENERATE`` is off, every call gathers layer by layer."""
    device = strategy.root_device
    ranks_on_device = strategy.num_processes if device.type == "cpu" else 1  # on the CPU they share the host's memory
    budget, synced = strategy.spec.generation_memory, strategy.world_size > 1
    for model in generating_models(strategy.lightning_module):
        if isinstance(vars(model).get("generate"), _GatheringCall):
            continue
        gather_once = available(GENERATE)
        call = _GatheringCall(model, lambda: strategy.model, budget, ranks_on_device, synced, gather_once)
        ledger.set_attribute(model, "generate", functools.update_wrapper(call, model.generate))


def choose_mode(model: nn.Module, budget: Optional[int], ranks_on_device: int) -> tuple[str, str]:
    """The mode of one ``generate`` call of ``model`` under ``budget`` (bytes; None: :data:`AUTO_FRACTION` of the free
    memory, shared by ``ranks_on_device``), and why. Collective when ``budget`` is None: every rank gathers, or none."""
    whole = whole_bytes(model)
    if budget is None:
        budget = int(AUTO_FRACTION * available_bytes() / max(1, ranks_on_device))
        fits = all(gather_objects(whole <= budget))
        source = f"auto: half the free memory, {format_bytes(budget)} on this rank"
    else:
        fits, source = whole <= budget, format_bytes(budget)
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}))
    size = f"the model is {format_bytes(whole)} whole in {dtypes}"
    if fits:
        return GATHER_ONCE, f"{size}, within `generation_memory` ({source})"
    return PER_LAYER, f"{size}, over `generation_memory` ({source}); raise it to gather the model once per call"


class _GatheringCall:
    """A model's ``generate``, gathering its params once per call when they fit (nested calls pass through)."""

    def __init__(
        self,
        model: nn.Module,
        engine: Callable[[], Any],
        budget: Optional[int],
        ranks: int,
        synced: bool,
        gather_once: bool,
    ) -> None:
        self.model, self.generate, self.engine = model, model.generate, engine
        self.budget, self.ranks, self.gather_once = budget, ranks, gather_once
        self.synced = synced  # several ranks: each runs as many forwards as the one that generates longest
        self.noticed: set[str] = set()
        self.depth = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.depth:
            return self.generate(*args, **kwargs)
        if self.synced and kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True
        mode, why = choose_mode(self.model, self.budget, self.ranks) if self.gather_once else (PER_LAYER, _OFF)
        if mode not in self.noticed:
            self.noticed.add(mode)
            rank_zero_info(f"lightning-frozen: generate() gathers the frozen base {mode}: {why}.")
        self.depth += 1
        try:
            if mode == PER_LAYER:
                return self.generate(*args, **kwargs)
            with gathered_once(self.model, self.engine()):
                return self.generate(*args, **kwargs)
        finally:
            self.depth -= 1
