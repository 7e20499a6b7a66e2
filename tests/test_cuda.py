"""The CUDA path: frozen shards in CPU memory, trainable shards on the GPU, bf16, checkpoint round trip.

Skipped where there is no CUDA device (this project's CI and development machines have none); run by
``scripts/gpu_check.sh`` on a GPU machine. Not yet run on a GPU: see CHANGELOG.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_frozen
from tests.models import AdapterModel, regression_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_trainer(strategy: str = "frozen_deepspeed", **kwargs: object) -> object:
    import lightning as L

    return L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kwargs,
    )


def _big_model() -> AdapterModel:
    return AdapterModel(width=2048, depth=6, rank=8)  # 25M frozen params: 50 MB in bf16


def test_frozen_shards_live_in_cpu_memory_and_trainable_ones_on_the_gpu() -> None:
    model = _big_model()
    trainer = _gpu_trainer()
    trainer.fit(model, regression_data(width=2048))
    for name, param in model.named_parameters():
        assert param.ds_tensor.dtype == torch.bfloat16, name
        expected = "cuda" if param.requires_grad else "cpu"
        assert param.ds_tensor.device.type == expected, name


def test_offloading_frozen_shards_saves_their_size_in_gpu_memory() -> None:
    peaks = {}
    for strategy in ("frozen_deepspeed_no_offload", "frozen_deepspeed"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        model = _big_model()
        _gpu_trainer(strategy).fit(model, regression_data(width=2048))
        peaks[strategy] = torch.cuda.max_memory_allocated() - baseline
        del model
    frozen_bytes = sum(p.numel() for p in _big_model().parameters() if not p.requires_grad) * 2
    assert peaks["frozen_deepspeed_no_offload"] - peaks["frozen_deepspeed"] > 0.8 * frozen_bytes, peaks


def test_checkpoint_round_trip_on_the_gpu(tmp_path: Path) -> None:
    trainer = _gpu_trainer()
    trainer.fit(_big_model(), regression_data(width=2048))
    trainer.save_checkpoint(tmp_path / "gpu.ckpt")
    resumed = _gpu_trainer(max_steps=5)
    resumed.fit(_big_model(), regression_data(width=2048), ckpt_path=tmp_path / "gpu.ckpt")
    assert resumed.global_step == 5
    module = lightning_frozen.load_adapter(_big_model(), tmp_path / "gpu.ckpt")
    saved = torch.load(tmp_path / "gpu.ckpt", weights_only=True)["state_dict"]["head.weight"]
    torch.testing.assert_close(module.head.weight, saved)


@pytest.mark.parametrize("frozen_dtype", ["int8", "nf4"])
def test_quantized_frozen_shards_stay_in_cpu_memory_and_dequantize_on_the_gpu(frozen_dtype: str) -> None:
    from lightning_frozen import FrozenAwareDeepSpeedStrategy, quant

    model = _big_model()
    source = model.layers[0].base.weight.detach().to(torch.bfloat16).clone()
    seen: dict[str, torch.Tensor] = {}

    def keep_first_weight(module: torch.nn.Module, inputs: tuple) -> None:
        seen.setdefault("weight", module.weight.detach().clone())

    model.layers[0].base.register_forward_pre_hook(keep_first_weight)
    _gpu_trainer(FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype)).fit(model, regression_data(width=2048))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert {(p.ds_tensor.dtype, p.ds_tensor.device.type) for p in frozen} == {(torch.uint8, "cpu")}
    stored = sum(p.ds_tensor.numel() for p in frozen)
    assert stored / sum(p.ds_numel * 2 for p in frozen) <= {"int8": 0.52, "nf4": 0.28}[frozen_dtype]
    assert seen["weight"].device.type == "cuda" and seen["weight"].dtype == torch.bfloat16
    expected = quant.decode(quant.encode(source.reshape(-1), frozen_dtype), source.numel(), frozen_dtype)
    torch.testing.assert_close(seen["weight"].cpu(), expected.to(torch.bfloat16).view_as(source), rtol=0, atol=0)
