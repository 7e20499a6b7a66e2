"""The memory estimate: hand-computed bytes, placement, a real 1-process ZeRO-3 run, and a 13B model on ``meta``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

import lightning_frozen
from lightning_frozen import memory
from lightning_frozen.cli import main
from tests.models import AdapterModel, cpu_trainer, regression_data


def _frozen_body_trainable_head() -> nn.Module:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2))  # 110 frozen, 22 trainable elements
    model[0].requires_grad_(False)
    return model


def test_estimate_matches_hand_computed_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    estimate = lightning_frozen.estimate_memory(
        _frozen_body_trainable_head(), num_devices=2, precision="bf16-mixed", reduce_bucket_size=1000
    )
    assert (estimate.trainable_params, estimate.frozen_params, estimate.world_size) == (22, 110, 2)
    assert estimate.frozen_shards == 55 * 2  # half of the frozen elements in bf16, in CPU memory
    assert estimate.trainable_weights == 11 * 2
    assert estimate.gradients == 11 * 4
    assert estimate.optimizer_state == 11 * (4 + 8)  # fp32 master + two Adam moments
    assert estimate.gathered_params == 110 * 2  # the frozen Linear(10, 10), gathered whole in bf16
    assert estimate.gradient_bucket == 1000 * 2
    assert estimate.limit_bytes == 110 + 22 + 44 + 132
    assert estimate.device_bytes == 22 + 44 + 132 + 220 + 2000
    assert estimate.host_bytes == 110
    assert estimate.lr_zero_workaround_extra == 55 * (4 + 8 + 4)
    printed = capsys.readouterr().out
    assert "frozen shards / rank" in printed and "110 B  host" in printed


def test_precision_defaults_to_the_trainers_and_the_table_says_what_was_assumed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = _frozen_body_trainable_head()
    default = lightning_frozen.estimate_memory(model, reduce_bucket_size=0)
    table = capsys.readouterr().out.splitlines()
    bf16 = lightning_frozen.estimate_memory(model, precision="bf16-mixed", frozen_dtype="nf4", print_table=False)

    assert default.frozen_shards == 110 * 4  # fp32: the Trainer's default precision, "32-true"
    assert table[0].split() == ["precision", "32-true", "Trainer's", "`precision`"]
    assert table[1].split() == ["frozen", "dtype", "None", "strategy's", "`frozen_dtype`"]
    assert bf16.table().splitlines()[0].split()[1] == "bf16-mixed" and "nf4" in bf16.table().splitlines()[1]


def test_offload_flags_move_bytes_between_device_and_host() -> None:
    model = _frozen_body_trainable_head()
    on_device = lightning_frozen.estimate_memory(model, offload_frozen=False, reduce_bucket_size=0, print_table=False)
    offloaded = lightning_frozen.estimate_memory(model, offload_optimizer=True, reduce_bucket_size=0, print_table=False)
    assert on_device.host_bytes == 0
    assert on_device.device_bytes == offloaded.device_bytes + on_device.frozen_shards + on_device.optimizer_state
    assert offloaded.host_bytes == offloaded.frozen_shards + offloaded.optimizer_state
    assert on_device.limit_bytes == offloaded.limit_bytes


def test_nodes_multiply_devices_and_bad_arguments_raise() -> None:
    model = _frozen_body_trainable_head()
    assert lightning_frozen.estimate_memory(model, num_devices=2, num_nodes=3, print_table=False).world_size == 6
    with pytest.raises(ValueError, match="num_devices and num_nodes"):
        lightning_frozen.estimate_memory(model, num_devices=0)
    with pytest.raises(ValueError, match="Unknown precision 'fp8'"):
        lightning_frozen.estimate_memory(model, precision="fp8")


def test_estimate_matches_the_shards_of_a_real_zero3_run() -> None:
    model = AdapterModel(width=64, depth=3, rank=4)
    before = lightning_frozen.estimate_memory(model, precision="32-true", reduce_bucket_size=0, print_table=False)
    cpu_trainer(max_steps=2).fit(model, regression_data(width=64))

    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert all(p.numel() == 0 for p in frozen), "ZeRO-3 should have partitioned the frozen params away"
    shard_bytes, shard_device = memory.measured_frozen_shard_bytes(frozen)
    assert (shard_bytes, shard_device) == (before.frozen_shards, "cpu")
    after = lightning_frozen.estimate_memory(model, precision="32-true", reduce_bucket_size=0, print_table=False)
    assert after == before  # counts the full size of partitioned params


def test_13b_lora_on_meta_fits_one_24gb_gpu_only_with_the_base_offloaded() -> None:
    pytest.importorskip("transformers")
    from tests.meta_models import fits, llama_13b_lora

    model = llama_13b_lora()
    assert all(p.is_meta for p in model.parameters())
    offloaded = lightning_frozen.estimate_memory(model, precision="bf16-mixed", print_table=False)
    on_gpu = lightning_frozen.estimate_memory(model, precision="bf16-mixed", offload_frozen=False, print_table=False)

    assert 12.9e9 < offloaded.frozen_params < 13.1e9
    assert offloaded.trainable_params == 40 * 2 * 16 * (5120 + 5120)  # r=16 A and B on q_proj and v_proj
    assert offloaded.trainable_params / offloaded.frozen_params == pytest.approx(0.001, rel=0.02)
    assert offloaded.host_bytes == offloaded.frozen_shards == 2 * offloaded.frozen_params
    assert fits(offloaded) and offloaded.device_bytes < 2 * 10**9
    assert not fits(on_gpu)


def test_load_estimate_counts_the_base_once_per_node_and_each_ranks_bytes_in_flight(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = _frozen_body_trainable_head()  # 110 frozen (largest module: the frozen Linear(10, 10)), 22 trainable
    estimate = lightning_frozen.estimate_memory(model, num_devices=2, precision="bf16-mixed")

    # zero.Init creates the Linear(10, 10) whole (110 x 2 B), one tensor's slice is read (55 x 2 B), fp32 adapters
    assert estimate.load_in_flight == 110 * 2 + 55 * 2 + 22 * 4
    assert estimate.host_load_bytes == 110 * 2 + 2 * estimate.load_in_flight  # the base once, two ranks in flight
    assert "host at load / node" in capsys.readouterr().out
    two_nodes = lightning_frozen.estimate_memory(
        model, num_devices=2, num_nodes=2, precision="bf16-mixed", print_table=False
    )
    assert (two_nodes.ranks_per_node, two_nodes.load_in_flight) == (2, 110 * 2 + 28 * 2 + 22 * 4)
    assert two_nodes.host_load_bytes == 2 * 28 * 2 + 2 * two_nodes.load_in_flight  # its two ranks: half the base
    on_device = lightning_frozen.estimate_memory(
        model, num_devices=2, precision="bf16-mixed", offload_frozen=False, print_table=False
    )
    assert on_device.host_load_bytes == 2 * on_device.load_in_flight  # the shards go to the accelerator


def test_load_estimate_of_a_llama_on_meta_is_bounded_by_its_embedding_created_whole_per_rank() -> None:
    transformers = pytest.importorskip("transformers")
    import torch
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    with torch.device("meta"):
        model = get_peft_model(transformers.LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj"]))
    estimate = lightning_frozen.estimate_memory(model, num_devices=8, precision="bf16-mixed", print_table=False)

    base_bytes = 2 * sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = 2 * 4 * (64 + 64)  # r=4 A and B of q_proj, two layers
    assert estimate.trainable_params == trainable
    assert estimate.load_in_flight == (64_000 + 8_000) * 2 + trainable * 4  # embed_tokens whole + its 1/8 slice
    assert estimate.host_load_bytes == base_bytes + 8 * estimate.load_in_flight


def test_fit_summary_tells_the_host_memory_the_load_needs_per_node(lightning_log: Any) -> None:
    model = AdapterModel(width=64, depth=3, rank=4)
    expected = lightning_frozen.estimate_memory(model, precision="32-true", print_table=False)
    cpu_trainer(max_steps=1).fit(model, regression_data(width=64))

    assert expected.host_load_bytes == expected.frozen_params * 4 + expected.load_in_flight
    assert (
        f"Loading the base in `configure_model` needs about {memory.format_bytes(expected.host_load_bytes)} of host"
        f" memory per node (1 rank(s), each with {memory.format_bytes(expected.load_in_flight)} in flight)."
    ) in lightning_log.text


def test_a_quantized_base_is_loaded_at_its_quantized_size() -> None:
    model = _frozen_body_trainable_head()
    plain = lightning_frozen.estimate_memory(model, num_devices=2, print_table=False)
    nf4 = lightning_frozen.estimate_memory(model, num_devices=2, frozen_dtype="nf4", print_table=False)
    assert nf4.frozen_shards < plain.frozen_shards  # stored as codes
    # and loaded as codes: the sliced loader encodes each slice as it reads it
    assert nf4.host_load_bytes == 2 * (nf4.frozen_shards + nf4.load_in_flight) < plain.host_load_bytes


def test_a_moe_base_counts_every_expert_frozen_what_a_token_uses_and_what_a_step_gathers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("peft")
    from tests.pretrained_support import MoELoRA, moe_folder, token_data

    folder = moe_folder(tmp_path / "base", "qwen3_moe")
    built = MoELoRA(str(folder))
    built.configure_model()
    estimate = lightning_frozen.estimate_memory(built, frozen_dtype="nf4", print_table=False)
    one_layer = 4 * (2 * 24 * 64 + 64 * 24)  # 4 experts: gate_up_proj [4, 48, 64] and down_proj [4, 64, 24]
    assert (estimate.experts, estimate.experts_per_token, estimate.expert_params) == (4, 2, 2 * one_layer)
    everything = estimate.trainable_params + estimate.frozen_params
    assert estimate.active_params == everything - one_layer  # top-2 of 4: half the experts idle, in both layers
    assert estimate.gathered_params == one_layer * 4  # a layer's fused experts, one ZeRO-3 param each, whole in fp32
    assert estimate.gathered_per_step == everything * 4
    rows = {line[:26].strip(): line[26:].split() for line in estimate.table().splitlines()}
    assert rows["experts"][:4] == ["top-2", "of", "4", "per"] and rows["expert params"][0] == f"{2 * one_layer:,}"

    # measured: a real run stores every expert as nf4 codes, as the estimate counted them
    trainer = cpu_trainer(lightning_frozen.FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4"), max_steps=1)
    module = MoELoRA(str(folder))
    trainer.fit(module, token_data())
    measured, device = memory.measured_frozen_shard_bytes([p for p in module.parameters() if not p.requires_grad])
    assert device == "cpu" and measured == pytest.approx(estimate.frozen_shards, rel=0.01)

    main(["estimate", str(folder / "config.json"), "--frozen-dtype", "nf4", "--target-modules", "q_proj", "v_proj"])
    printed = capsys.readouterr().out
    assert "top-2 of 4" in printed and f"{2 * one_layer:,}" in printed and "gathered per forward" in printed
