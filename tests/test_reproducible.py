"""Seeded fits in one process train alike: the first fit of a fresh process (which builds or loads the codec's kernels
and imports transformers, PEFT and DeepSpeed), a fit that writes the code cache and one that maps it each leave the
global torch generator where the user's seed put it, so PEFT's LoRA init and the training after it are the same. The
fits run in a fresh process of their own (this file, run as a script): first-time code runs once per process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPOSITORY = Path(__file__).resolve().parents[1]


def test_the_first_seeded_fit_of_a_process_trains_like_the_next_ones(tmp_path: Path) -> None:
    from tests.distributed import fresh_env
    from tests.pretrained_support import write_llama

    folder = write_llama(tmp_path / "llama")
    report = tmp_path / "report.json"
    command = [sys.executable, __file__, str(folder), str(tmp_path / "codes"), str(report)]
    result = subprocess.run(command, env=fresh_env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-6000:]

    fits = json.loads(report.read_text())
    assert [fit["code_cache"] for fit in fits] == ["off", "writes", "maps"]
    for fit in fits:
        assert fit["trained"] == 8, fit  # lora_A and lora_B of q and v in two layers
        assert fit["generator_moved_by_load"] is False, fit
        assert fit["largest_difference_to_the_first"] == 0.0, fit


def _fits(folder: str, cache: Path, report: Path) -> None:
    import lightning as L

    from lightning_frozen import FrozenAwareDeepSpeedStrategy
    from tests.models import cpu_trainer
    from tests.pretrained_support import PretrainedLoRA, token_data

    class Watched(PretrainedLoRA):
        def load_base(self) -> torch.nn.Module:
            before = torch.get_rng_state()
            base = super().load_base()
            self.generator_moved_by_load = not torch.equal(before, torch.get_rng_state())
            return base

    fits: list[dict[str, Any]] = []
    first: dict[str, torch.Tensor] = {}
    for code_cache, setting in (("off", False), ("writes", cache), ("maps", cache)):
        L.seed_everything(0, verbose=False)
        model = Watched(folder)
        strategy = FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4", code_cache=setting)
        cpu_trainer(strategy, max_steps=2, precision="bf16-true").fit(model, token_data())
        trained = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
        first = first or trained
        difference = max(float((trained[n] - first[n]).abs().max()) for n in first)
        fits.append(
            dict(
                code_cache=code_cache,
                trained=len(trained),
                generator_moved_by_load=model.generator_moved_by_load,
                largest_difference_to_the_first=difference,
            )
        )
    report.write_text(json.dumps(fits))


if __name__ == "__main__":
    sys.path.insert(0, str(REPOSITORY))
    _fits(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
