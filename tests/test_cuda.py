"""The CUDA path: frozen shards in CPU memory, trainable shards on the GPU, bf16, checkpoint round trip.

Skipped where there is no CUDA device (this project's CI and development machines have none); run by
``scripts/gpu_check.sh`` on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_frozen
from tests.models import AdapterModel, regression_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_trainer(strategy: object = "frozen_deepspeed", **kwargs: object) -> object:
    import lightning as L

    options: dict = dict(precision="bf16-mixed", max_steps=3, logger=False, enable_checkpointing=False)
    options.update(kwargs)
    return L.Trainer(accelerator="gpu", devices=1, strategy=strategy, enable_progress_bar=False, **options)


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


def test_validate_and_fit_again_after_fit_on_the_same_module() -> None:
    # Lightning's teardown moves the module to the CPU: ZeRO-3's placeholders and kept-whole small params with it
    model, data = _big_model(), regression_data(width=2048)
    trainer = _gpu_trainer(max_steps=2)
    trainer.fit(model, data)
    first = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    again = _gpu_trainer(max_steps=2)
    again.fit(model, data)
    second = again.validate(model, data, verbose=False)[0]["val_loss"]
    assert torch.isfinite(torch.tensor([first, second])).all() and second != first, (first, second)


class _BuffersEverywhere(L.LightningModule):
    """MiniLM (``position_ids``/``token_type_ids`` buffers) built in ``configure_model``, a frozen BatchNorm tower
    (running statistics) and a torchmetrics metric (states outside ``_buffers``): the buffers a GPU run meets."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.BatchNorm1d(384)).requires_grad_(False)
        self.head = torch.nn.Linear(384, 2)
        from torchmetrics.classification import MulticlassAccuracy

        self.accuracy = MulticlassAccuracy(num_classes=2)

    def configure_model(self) -> None:
        if hasattr(self, "encoder"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModel

        from examples.minilm_lora.task import minilm_folder

        base = AutoModel.from_pretrained(minilm_folder())
        self.encoder = get_peft_model(base, LoraConfig(r=4, target_modules=["query", "value"]))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        pooled = self.encoder(input_ids=ids).last_hidden_state.mean(1)
        logits = self.head(self.tower(pooled))
        self.accuracy(logits, labels)
        return torch.nn.functional.cross_entropy(logits.float(), labels)

    def on_train_batch_end(self, *args: object) -> None:
        # during the run: Lightning's teardown moves the module's buffers (not its ZeRO-3 shards) to the CPU after it
        self.devices_in_training = {name: buffer.device.type for name, buffer in self.named_buffers()}
        self.devices_in_training["accuracy.tp"] = self.accuracy.tp.device.type

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_every_buffer_and_trainable_shard_is_on_the_gpu_frozen_shards_in_cpu_memory() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    model = _BuffersEverywhere()
    data = DataLoader(TensorDataset(torch.randint(0, 1000, (16, 12)), torch.randint(0, 2, (16,))), batch_size=8)
    _gpu_trainer().fit(model, data)
    assert set(model.devices_in_training.values()) == {"cuda"}, model.devices_in_training
    assert "tower.1.running_mean" in model.devices_in_training
    for name, param in model.named_parameters():
        assert param.ds_tensor.device.type == ("cuda" if param.requires_grad else "cpu"), name


def test_from_pretrained_in_configure_model_on_the_gpu(tmp_path: Path) -> None:
    from tests.pretrained_support import PretrainedLoRA, token_data, write_llama

    model = PretrainedLoRA(str(write_llama(tmp_path / "llama")))
    _gpu_trainer().fit(model, token_data())
    seen = model.seen_at_start
    assert all(seen["frozen_equal"].values()) and all(seen["lora_b_zero"].values())
    for name, shard in seen["shards"].items():
        assert shard["device"] == ("cuda" if shard["trainable"] else "cpu"), name
        assert shard["dtype"] == "bfloat16", name
    assert set(seen["buffers"].values()) == {"cuda"}


def test_fp16_loss_scale_round_trips_and_the_fp16_base_verifies_in_fp32(tmp_path: Path) -> None:
    # `16-mixed`: DeepSpeed's dynamic loss scaler, which the CPU accelerator here cannot run (no fp16 support);
    # a small initial scale and window so that it changes within a few steps
    from lightning_frozen import FrozenAwareDeepSpeedStrategy

    def fit(max_steps: int, name: str, resume: Path | None = None) -> dict:
        strategy = FrozenAwareDeepSpeedStrategy(initial_scale_power=4, loss_scale_window=2)
        trainer = _gpu_trainer(strategy, precision="16-mixed", max_steps=max_steps, max_epochs=-1)
        trainer.fit(AdapterModel(), regression_data(samples=8), ckpt_path=resume)
        trainer.save_checkpoint(tmp_path / name)
        return torch.load(tmp_path / name, weights_only=True)

    half = fit(4, "half.ckpt")
    straight, resumed = fit(8, "straight.ckpt"), fit(8, "resumed.ckpt", resume=tmp_path / "half.ckpt")
    scaler = half["optimizer_states"][0]["loss_scaler"]
    assert scaler["cur_iter"] == 4 and scaler["cur_scale"] != 2.0**4, scaler
    assert resumed["optimizer_states"][0]["loss_scaler"] == straight["optimizer_states"][0]["loss_scaler"]
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value)
    assert {t["dtype"] for t in straight["frozen_base"]["fingerprint"]["tensors"].values()} == {"float16"}
    lightning_frozen.load_adapter(AdapterModel(), tmp_path / "straight.ckpt")  # fp32 base: verifies


@pytest.mark.parametrize("frozen_dtype", ["int8", "nf4"])
def test_quantized_frozen_shards_stay_in_cpu_memory_and_dequantize_on_the_gpu(frozen_dtype: str) -> None:
    from lightning_frozen import FrozenAwareDeepSpeedStrategy
    from lightning_frozen.format import codec

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
    expected = codec.decode(codec.encode(source.reshape(-1), frozen_dtype), source.numel(), frozen_dtype)
    torch.testing.assert_close(seen["weight"].cpu(), expected.to(torch.bfloat16).view_as(source), rtol=0, atol=0)


@pytest.mark.parametrize("frozen_dtype", ["int8", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_decode_on_cuda_to_the_cpu_kernels_values(frozen_dtype: str, dtype: torch.dtype) -> None:
    """NF4 on CUDA is bitsandbytes' kernel, int8 tensor ops; both must give the CPU kernels' values to the bit."""
    from lightning_frozen.format import bitsandbytes_nf4, codec

    values = torch.randn(64 * 1000 + 10, generator=torch.Generator().manual_seed(0)) * 0.05
    stored = codec.encode(values, frozen_dtype)
    on_cpu = codec.decode(torch.stack([stored, stored]), values.numel(), frozen_dtype, dtype)
    on_gpu = codec.decode(torch.stack([stored, stored]).cuda(), values.numel(), frozen_dtype, dtype)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.equal(codec.encode(values.cuda(), frozen_dtype).cpu(), stored)
    if frozen_dtype == "nf4":
        assert bitsandbytes_nf4.usable(torch.device("cuda"))
