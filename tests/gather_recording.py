"""Which ZeRO-3 gathers were in flight while other layers computed: a recorder for the multi-process test scripts.

Every ``all_gather_into_tensor`` through ``deepspeed.comm`` is recorded (DeepSpeed's own gathers call it in
``deepspeed.comm.comm``, the quantized gather through ``deepspeed.comm``): its dtype, whether it was started with
``async_op=True``, the step it ran in, and how many watched forwards had begun when it started and when its work was
waited on. A gather that DeepSpeed prefetched, and that stayed in flight while another layer computed, shows
``waited_at > started_at``; one fetched for the layer about to run is waited on at once.
"""

from __future__ import annotations

from typing import Any

import deepspeed.comm
import deepspeed.comm.comm
import torch


class GatherRecorder:
    """Counts the forwards of the modules it watches (:meth:`watch`) and, per collective, those that began while it
    was in flight; ``step`` is stamped on each gather (the script sets it)."""

    def __init__(self) -> None:
        self.reset()
        original = deepspeed.comm.comm.all_gather_into_tensor

        def recording(output: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            entry = {"dtype": str(tensor.dtype), "async_op": bool(kwargs.get("async_op")), "step": self.step}
            entry.update(started_at=self.forwards, waited_at=None)
            self.gathers.append(entry)
            work = original(output, tensor, *args, **kwargs)
            return _RecordedWork(work, entry, self) if work is not None else None

        deepspeed.comm.all_gather_into_tensor = recording
        deepspeed.comm.comm.all_gather_into_tensor = recording

    def reset(self) -> None:
        """Forget what was recorded, for the next run (gathers at its setup are stamped with step -1)."""
        self.forwards, self.step = 0, -1
        self.gathers: list[dict[str, Any]] = []

    def watch(self, module: torch.nn.Module) -> None:
        """Count ``module``'s forwards; call before the engine is built, so that the count is taken before ZeRO-3's
        own hook fetches the module's params."""
        module.register_forward_pre_hook(self.on_forward)

    def on_forward(self, module: torch.nn.Module, inputs: tuple) -> None:
        self.forwards += 1


class _RecordedWork:
    def __init__(self, work: Any, entry: dict[str, Any], recorder: GatherRecorder) -> None:
        self.work, self.entry, self.recorder = work, entry, recorder

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self.entry["waited_at"] is None:
            self.entry["waited_at"] = self.recorder.forwards
        return self.work.wait(*args, **kwargs)
