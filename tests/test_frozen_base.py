"""The frozen-base reference and fingerprint, without a Trainer; and a module with two bases, trained and verified."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from examples.causal_lm_lora.make_base import write_random_llama
from lightning_frozen import FrozenAwareDeepSpeedStrategy, load_adapter
from lightning_frozen.base.fingerprint import fingerprint_base, verify_base
from lightning_frozen.errors import FrozenBaseMismatchError
from lightning_frozen.hf.reference import find_base_reference
from lightning_frozen.zero import frozen_storage
from tests.models import AdapterModel, cpu_trainer
from tests.pretrained_support import TINY_LLAMA

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _frozen(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in module.named_parameters() if not p.requires_grad]


def test_reference_from_argument_then_hugging_face_config_then_attribute() -> None:
    transformers = pytest.importorskip("transformers")
    model = AdapterModel()
    assert find_base_reference(model) == "tests/adapter-model"
    assert find_base_reference(model, explicit="s3://bucket/base") == "s3://bucket/base"
    config = transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    config._name_or_path = "org/bert-tiny"
    model.encoder = transformers.BertModel(config)
    assert find_base_reference(model) == "org/bert-tiny"
    assert find_base_reference(nn.Linear(2, 2)) is None


def test_checksum_sees_one_changed_value_and_a_swap() -> None:
    model = AdapterModel()
    recorded = fingerprint_base(_frozen(model))
    assert fingerprint_base(_frozen(AdapterModel()))["digest"] == recorded["digest"]
    with torch.no_grad():
        model.layers[0].base.weight[5, 9] *= 1.5
    assert fingerprint_base(_frozen(model))["digest"] != recorded["digest"]

    swapped = AdapterModel()
    with torch.no_grad():
        weight = swapped.layers[1].base.weight
        weight[0, 0], weight[0, 1] = weight[0, 1].clone(), weight[0, 0].clone()
    with pytest.raises(
        FrozenBaseMismatchError, match=r"tests/adapter-model.*`layers\.1\.base\.weight` holds different"
    ):
        verify_base(recorded, _frozen(swapped), "tests/adapter-model", "run.ckpt")


def test_a_bf16_base_verifies_against_the_same_base_in_fp32() -> None:
    model = AdapterModel()
    recorded = fingerprint_base(_frozen(model.to(torch.bfloat16)))
    verify_base(recorded, _frozen(AdapterModel()), "ref", "run.ckpt")


def _double_rounding_base() -> nn.Module:
    """A frozen base whose fp32 values include ones that fp16 rounds onto a bf16 rounding midpoint, fp16 subnormals,
    values beyond fp16's range, zeros and a negative zero."""
    torch.manual_seed(0)
    values = torch.randn(4096) * torch.logspace(-9, 6, 4096)
    # just below / above the midpoint between bf16 neighbours 1.0 and 1.0078125: fp16 lands on the midpoint
    values[:4] = torch.tensor([1.00390601, 1.00390649, -3.0117178, 0.0])
    values[4] = -0.0
    module = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        module.weight.copy_(values.reshape(64, 64))
    return module.requires_grad_(False)


def test_an_fp16_base_verifies_against_fp32_and_a_bf16_base_against_fp32_both_ways() -> None:
    fp32 = _double_rounding_base()
    weight = fp32.weight
    # the case a single cast to bf16 gets wrong: fp16 then bf16 differs from bf16 for some of these values
    assert not torch.equal(weight.half().bfloat16(), weight.bfloat16())
    recorded = {dtype: fingerprint_base(_frozen(_double_rounding_base().to(dtype))) for dtype in _DTYPES}
    for trained, held in [
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
    ]:
        verify_base(recorded[trained], _frozen(_double_rounding_base().to(held)), "ref", f"{trained}->{held}")

    # one fp16 step off in one value is seen in every pairing with fp16
    changed = _double_rounding_base().half()
    with torch.no_grad():
        changed.weight[10, 3] = torch.nextafter(changed.weight[10, 3], torch.tensor(1e9, dtype=torch.float16))
    for trained in (torch.float16, torch.float32):
        with pytest.raises(FrozenBaseMismatchError, match=r"`weight` holds different values \(float16 here"):
            verify_base(recorded[trained], _frozen(changed), "ref", "run.ckpt")


def test_an_fp16_base_against_a_bf16_one_is_named_as_not_comparable() -> None:
    recorded = fingerprint_base(_frozen(_double_rounding_base().half()))
    assert set(recorded["tensors"]["weight"]) == {"shape", "dtype", "value_fp16"}
    with pytest.raises(
        FrozenBaseMismatchError, match=r"bfloat16 here and was in float16 when trained.*load the base in"
    ):
        verify_base(recorded, _frozen(_double_rounding_base().bfloat16()), "ref", "run.ckpt")


def test_shape_and_name_differences_are_named() -> None:
    recorded = fingerprint_base(_frozen(AdapterModel()))
    wider = AdapterModel(width=16)
    with pytest.raises(FrozenBaseMismatchError, match=r"`layers\.0\.base\.weight` has shape \[16, 16\]"):
        verify_base(recorded, _frozen(wider), None, "run.ckpt")
    deeper = AdapterModel(depth=3)
    with pytest.raises(FrozenBaseMismatchError, match=r"`layers\.2\.base\.bias` is frozen in the module but was not"):
        verify_base(recorded, _frozen(deeper), None, "run.ckpt")


def test_sha256_mode_hashes_exact_bytes_and_none_checks_nothing() -> None:
    fp32 = fingerprint_base(_frozen(AdapterModel()), mode="sha256")
    assert all(len(t["value"]) == 64 for t in fp32["tensors"].values())
    bf16 = fingerprint_base(_frozen(AdapterModel().to(torch.bfloat16)), mode="sha256")
    assert bf16["digest"] != fp32["digest"]
    verify_base(fingerprint_base(_frozen(AdapterModel()), mode="none"), _frozen(AdapterModel(seed=4)), None, "x")
    with pytest.raises(ValueError, match="md5"):
        fingerprint_base(_frozen(AdapterModel()), mode="md5")


def test_fingerprint_progress_lines_go_forward_with_rate_and_time_left(
    lightning_log: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_frozen import progress

    monkeypatch.setattr(progress, "INTERVAL_SECONDS", -1.0)  # a line for every tensor
    fingerprint_base([(f"t{i}", torch.full((1000 * (i + 1),), float(i))) for i in range(5)])
    lines = [line for line in lightning_log.lines if "fingerprinting the frozen base" in line]  # type: ignore[attr-defined]
    percents = [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert percents == [7, 20, 40, 67, 100]
    assert all("elements/s" in line for line in lines) and "s left" in lines[0] and "left" not in lines[-1]


def test_the_checksum_frees_its_buffers_after_a_pass() -> None:
    import gc
    import weakref

    from lightning_frozen.base import fingerprint

    checksummer = fingerprint.Checksummer()
    buffers = [weakref.ref(checksummer._wide), weakref.ref(checksummer._weights)]
    expected = checksummer(torch.arange(3000.0), 5)
    del checksummer
    gc.collect()
    assert all(ref() is None for ref in buffers)  # nothing cached for the life of the process
    assert fingerprint.Checksummer()(torch.arange(3000.0), 5) == expected  # a fresh one sums the same


class _VisionAndLanguage(L.LightningModule):
    """A frozen "vision tower" and a LoRA-adapted language model, each from its own ``save_pretrained`` folder."""

    def __init__(self, vision: str, language: str) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM, LlamaModel

        self.vision = LlamaModel.from_pretrained(vision).requires_grad_(False)
        self.language = get_peft_model(
            LlamaForCausalLM.from_pretrained(language), LoraConfig(r=2, target_modules=["q_proj"])
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        features = self.vision(input_ids=ids).last_hidden_state
        return self.language(inputs_embeds=features).logits.float().pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("frozen_dtype", [None, "nf4"])
def test_each_of_two_bases_is_recorded_and_a_mismatch_names_the_base_it_is_in(
    tmp_path: Path, frozen_dtype: Optional[str]
) -> None:
    """Two frozen folders (a vision tower and a language model; a teacher and a student's base alike): each stored as
    the strategy's ``frozen_dtype`` says, each named in the checkpoint, and a mismatch names its own folder."""
    folders = {name: str(tmp_path / name) for name in ("vision", "language")}
    for seed, folder in enumerate(folders.values()):
        write_random_llama(Path(folder), TINY_LLAMA, torch.float32, seed=seed)
    trainer = cpu_trainer(FrozenAwareDeepSpeedStrategy(frozen_dtype=frozen_dtype), max_steps=1)
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    trained = _VisionAndLanguage(**folders)
    trainer.fit(trained, DataLoader(TensorDataset(ids), batch_size=4))
    stored = {frozen_storage.frozen_dtype_of(p) for n, p in trained.named_parameters() if n.endswith("proj.weight")}
    assert stored == {frozen_dtype}  # the second base (the "teacher") is stored like the first
    trainer.save_checkpoint(tmp_path / "adapter.ckpt")
    entry = torch.load(tmp_path / "adapter.ckpt", weights_only=True)["frozen_base"]
    assert entry["bases"] == folders and entry["reference"] == folders["language"]  # the PEFT model's, as with one

    for changed in ("vision.layers.1.mlp.up_proj.weight", "language.base_model.model.model.embed_tokens.weight"):
        module = _VisionAndLanguage(**folders)
        with torch.no_grad():
            module.get_parameter(changed)[0, 0] += 1
        owner = folders[changed.split(".")[0]]
        with pytest.raises(FrozenBaseMismatchError, match=rf"`{re.escape(changed)}` \(of '{re.escape(owner)}'\) holds"):
            load_adapter(module, tmp_path / "adapter.ckpt")
    load_adapter(_VisionAndLanguage(**folders), tmp_path / "adapter.ckpt")  # the bases it was trained on


def _edge_values(count: int) -> torch.Tensor:
    torch.manual_seed(0)
    values = torch.randn(count) * 0.05
    values[::97] *= 1e6  # beyond fp16's range: inf there
    values[1::89] *= 1e-6  # fp16 subnormals, and zeros
    special = [-0.0, float("inf"), -float("inf"), 65504.0, 65520.0, 3.4e38, 2.0**-25, 1.5 * 2.0**-24, 1e-38]
    values[: len(special)] = torch.tensor(special)
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", ["openmp", "thread pool"])  # torch's OpenMP threads, or ours where it is missing
def test_the_compiled_checksum_gives_the_tensor_ops_sums(
    dtype: torch.dtype, split: str, monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    """The fingerprint of every base ever saved is these sums: the one-pass kernel must give them to the bit, at any
    start (the position weights wrap every 65521 values), over any length, rounding as torch casts."""
    from lightning_frozen.base import fingerprint
    from lightning_frozen.format import native_codec

    lib = native_codec.kernels()
    assert lib is not None, "the CPU kernels did not build: is a C compiler installed?"
    if split == "openmp" and not lib.lf_openmp():
        pytest.skip("the kernels were built without OpenMP (the compiler takes no -fopenmp)")
    if split == "thread pool":
        monkeypatch.setattr(lib, "lf_openmp", lambda: 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    values = _edge_values(2 * native_codec.CHECKSUM_UNIT + 65530).to(dtype)
    checksummer = fingerprint.Checksummer()
    compiled = {}
    for start in (0, 65520, 65521 * 3 + 7, 10**10 + 3):
        for count in (0, 1, 9, 65530, values.numel()):
            compiled[start, count] = native_codec.checksum16(values[:count], start)
    for (start, count), sums in compiled.items():
        assert sums == checksummer(values[:count], start), (start, count)
    assert len(compiled[0, 9]) == (4 if dtype == torch.float32 else 2)


def test_a_nan_weight_is_checksummed_by_the_tensor_ops() -> None:
    from lightning_frozen.base import fingerprint
    from lightning_frozen.format import native_codec

    values = _edge_values(5000)
    values[100] = float("nan")  # torch's scalar and vector casts to bf16 give it different patterns
    assert native_codec.checksum16(values, 0) is None
    expected = fingerprint.Checksummer()(values, 0)
    assert native_codec.checksum16(values[:100], 0) is not None and len(expected) == 4
