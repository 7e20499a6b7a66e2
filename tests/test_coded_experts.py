"""A MoE layer's fused experts computed from their gathered codes, only the experts the router picks
(zero/compute/coded_experts.py): the same output and input gradients as transformers' own forward over the decoded
weights, for Qwen3-MoE's and Mixtral's experts; only where that layout holds and no LoRA reads the fused params; and a
real fit that trains as the path that decodes them whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import lightning_frozen
from lightning_frozen.format import codec, native_codec
from lightning_frozen.hf import peft_adapters
from lightning_frozen.zero.compute import coded_experts, coded_linear
from lightning_frozen.zero.params import full_param
from tests.models import cpu_trainer
from tests.pretrained_support import EXPERTS, MOE_CONFIGS, TINY_LLAMA, PretrainedLoRA, moe_folder, token_data
from tests.test_coded_linear import coded_weight

ZOO = {"plain": "qwen3_moe", "transposed": "mixtral", "lora": "mixtral"}


def _experts(kind: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, **TINY_LLAMA, **MOE_CONFIGS[kind])
    return AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts


def _coded_experts(experts: nn.Module, frozen_dtype: str, layers: coded_linear.CodedLayers) -> dict[str, torch.Tensor]:
    """Give ``experts`` fused params coded as ``frozen_dtype``, as a 2-rank gather leaves them; return their decoded
    values."""
    decoded = {}
    for name in coded_experts.FUSED:
        weight = getattr(experts, name).detach()
        param = coded_weight(weight, frozen_dtype, layers)
        param.ds_tensor = torch.empty(1)  # a shard in CPU memory
        rows, numel, _ = layers.held_codes(param)
        decoded[name] = codec.decode(rows, numel, frozen_dtype)[: weight.numel()].view_as(weight)
        setattr(experts, name, param)
    return decoded


@pytest.mark.parametrize(("kind", "frozen_dtype"), [("qwen3_moe", "nf4"), ("mixtral", "nf4"), ("qwen3_moe", "int8")])
def test_the_routed_experts_compute_what_transformers_computes_from_the_decoded_weights(
    kind: str, frozen_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tiles of 3 rows: tiles straddle NF4's 64-weight blocks, the experts' matrices and the two shards
    monkeypatch.setattr(coded_linear, "TILE_ROWS", 3)
    monkeypatch.setattr(coded_linear, "TILE_ELEMENTS", 1)
    monkeypatch.setattr(coded_experts, "EXPERT_TILE_ELEMENTS", 1)
    reference = _experts(kind)
    layers = coded_linear.CodedLayers()
    experts = _experts(kind)
    decoded = _coded_experts(experts, frozen_dtype, layers)
    for name, values in decoded.items():
        setattr(reference, name, nn.Parameter(values, requires_grad=False))
    hidden = torch.randn(10, TINY_LLAMA["hidden_size"])
    index = torch.tensor([[0, 2], [2, 0], [0, 2]] * 3 + [[2, 0]])  # experts 1 and 3 get no token: never decoded
    routing = torch.rand(10, 2)
    decoded_rows = []
    tiles_of = layers.tiles_of
    monkeypatch.setattr(layers, "tiles_of", lambda w, e=None, n=None: decoded_rows.append(e) or tiles_of(w, e, n))
    kernel_offsets = []  # where the compiled kernels multiplied straight from the codes (rows on whole blocks)
    kernel_forward = native_codec.CodedMatmuls.forward
    monkeypatch.setattr(
        native_codec.CodedMatmuls,
        "forward",
        lambda self, offset, *a: kernel_offsets.append(offset) or kernel_forward(self, offset, *a),
    )

    outputs, grads = [], []
    for module, forward in (
        (experts, lambda *a: coded_experts._routed_forward(layers, (experts.gate_up_proj, experts.down_proj), {}, *a)),
        (reference, lambda *a: type(reference).forward(*a)),
    ):
        inputs = [hidden.clone().requires_grad_(True), index, routing.clone().requires_grad_(True)]
        output = forward(module, *inputs)
        output.backward(torch.linspace(-1, 1, output.numel()).view_as(output))
        outputs.append(output)
        grads.append((inputs[0].grad, inputs[2].grad))
    # up to the order of fp32 sums (a matrix's rows in tiles, the input's gradient summed over them in turn)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert set(decoded_rows) == {0, 2}  # forward and backward decoded only the routed experts
    if frozen_dtype == "nf4" and native_codec.blas_sgemm() is not None:  # gate_up_proj's 64-wide rows: the kernels
        matrix = experts.gate_up_proj.ds_shape[-2] * experts.gate_up_proj.ds_shape[-1]
        assert {offset // matrix for offset in kernel_offsets} == {0, 2}
    else:  # int8's blocks are 256 wide: row tiles only
        assert kernel_offsets == []
    assert torch.isnan(experts.gate_up_proj).all()  # the fused params were never decoded whole
    # gathered whole between forward and backward (GatheredParameters around the backward): the whole weights read
    inputs = [hidden.clone().requires_grad_(True), index, routing.clone().requires_grad_(True)]
    output = coded_experts._routed_forward(layers, (experts.gate_up_proj, experts.down_proj), {}, experts, *inputs)
    for name in coded_experts.FUSED:
        layers.decode_whole(getattr(experts, name))
    output.backward(torch.linspace(-1, 1, output.numel()).view_as(output))
    for ours, theirs in zip((inputs[0].grad, inputs[2].grad), grads[1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # gathered whole before the forward too: the same sort, expert by expert on the whole weights
    inputs = [hidden.clone().requires_grad_(True), index, routing.clone().requires_grad_(True)]
    output = coded_experts._routed_forward(layers, (experts.gate_up_proj, experts.down_proj), {}, experts, *inputs)
    output.backward(torch.linspace(-1, 1, output.numel()).view_as(output))
    for ours, theirs in zip((output, inputs[0].grad, inputs[2].grad), (outputs[1], *grads[1])):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_layer_of_routed_experts_is_one_autograd_node_a_projection_however_many_experts_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = coded_linear.CodedLayers()
    experts = _experts("qwen3_moe")
    _coded_experts(experts, "nf4", layers)
    count = experts.gate_up_proj.ds_shape[0]
    index = torch.stack([torch.arange(16) % count, (torch.arange(16) + 1) % count], dim=1)  # every expert runs
    hidden = torch.randn(16, TINY_LLAMA["hidden_size"], requires_grad=True)
    weights = (experts.gate_up_proj, experts.down_proj)
    output = coded_experts._routed_forward(layers, weights, {}, experts, hidden, index, torch.rand(16, 2))
    nodes, pending = [], [output.grad_fn]
    while pending:
        node = pending.pop()
        if node is not None and node not in nodes:
            nodes.append(node)
            pending.extend(next_node for next_node, _ in node.next_functions)
    assert [type(n).__name__ for n in nodes].count("CodedExpertsMatmulBackward") == 2  # gate_up and down
    assert len(nodes) < 20  # not a few nodes an expert


def test_pairs_sorted_by_expert_leave_out_an_index_that_marks_no_expert() -> None:
    # expert parallelism marks another rank's experts with the index `experts`: transformers skips those pairs
    counts, order = coded_experts._sorted_by_expert(torch.tensor([[2, 4], [0, 2], [4, 1]]), experts=4)
    assert counts == [1, 1, 2, 0]
    assert order.tolist() == [2, 5, 0, 3]  # flat (token, slot) indices: expert 0's, 1's, then 2's in token order


def _lora_experts(kind: str) -> tuple[nn.Module, nn.Module]:
    """``kind``'s experts with LoRA on both fused params (PEFT's ``ParamWrapper``), its B weights not zero: the PEFT
    model and the experts module inside it."""
    from peft import LoraConfig, get_peft_model

    model = nn.ModuleDict({"experts": _experts(kind)})
    torch.manual_seed(1)
    model = get_peft_model(
        model, LoraConfig(r=2, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.1)
    return model, model.base_model.model["experts"].get_base_layer()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_lora_on_the_routed_experts_computes_what_peft_computes_from_the_decoded_weights(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coded_linear, "TILE_ROWS", 3)
    monkeypatch.setattr(coded_linear, "TILE_ELEMENTS", 1)
    monkeypatch.setattr(coded_experts, "EXPERT_TILE_ELEMENTS", 1)
    layers = coded_linear.CodedLayers()
    model, experts = _lora_experts(kind)
    reference_model, reference = _lora_experts(kind)
    decoded = _coded_experts(experts, "nf4", layers)
    for name, values in decoded.items():
        setattr(reference, name, nn.Parameter(values, requires_grad=False))
    coded = {id(getattr(experts, name)) for name in coded_experts.FUSED}

    def stored_as(param: nn.Parameter) -> str | None:
        return "nf4" if id(param) in coded else None

    assert coded_experts.compute_experts_from_codes(layers, model, stored_as, peft_adapters.PARAM_LORA) == 1
    hidden = torch.randn(10, TINY_LLAMA["hidden_size"])
    index = torch.tensor([[0, 2], [2, 0], [0, 2]] * 3 + [[2, 0]])
    routing = torch.rand(10, 2)
    results = []
    for peft_model in (model, reference_model):
        inputs = [hidden.clone().requires_grad_(True), index, routing.clone().requires_grad_(True)]
        output = peft_model.base_model.model["experts"](*inputs)
        output.backward(torch.linspace(-1, 1, output.numel()).view_as(output))
        lora_grads = [p.grad for n, p in peft_model.named_parameters() if p.requires_grad]
        results.append([output, inputs[0].grad, inputs[2].grad, *lora_grads])
        assert not any(parametrize.is_parametrized(m) for m in peft_model.modules())
    assert len(results[0]) == 7  # output, 2 input gradients, A and B of each of the two fused params
    for ours, theirs in zip(*results):
        # up to the order of fp32 sums: PEFT adds scaling * lhs @ rhs to the weight, ours adds two thin matmuls
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert torch.isnan(experts.gate_up_proj).all()  # never decoded whole
    for name in coded_experts.FUSED:  # gathered whole (GatheredParameters, gather-once generate): LoRA still added
        layers.decode_whole(getattr(experts, name))
    with torch.no_grad():
        whole = model.base_model.model["experts"](hidden, index, routing)
    torch.testing.assert_close(whole, results[1][0], rtol=1e-4, atol=1e-5)


def test_only_fused_experts_in_the_concatenated_layout_are_computed_from_codes() -> None:
    from peft import LoraConfig, get_peft_model

    model = nn.ModuleDict({name: _experts(kind) for name, kind in ZOO.items()})
    model["transposed"].is_transposed = True  # another layout (gpt-oss stores its experts transposed, with biases)
    model = get_peft_model(model, LoraConfig(r=2, target_modules=[], target_parameters=["lora.gate_up_proj"]))
    for param in model.parameters():
        param.ds_tensor, param.ds_shape = torch.empty(1), param.shape  # a shard in CPU memory
    stored_as = {id(p): "nf4" for p in model.parameters() if not p.requires_grad}

    def frozen_dtype_of(param: nn.Parameter) -> str | None:
        return stored_as.get(id(param))

    layers = coded_linear.CodedLayers()
    assert coded_experts.compute_experts_from_codes(layers, model, frozen_dtype_of) == 1  # no reader of the wrapper
    assert "forward" not in vars(model.base_model.model["lora"])
    assert coded_experts.compute_experts_from_codes(layers, model, frozen_dtype_of, peft_adapters.PARAM_LORA) == 2
    plain, lora = model.base_model.model["plain"], model.base_model.model["lora"]
    assert "forward" in vars(plain) and layers.computes_from_codes(plain.gate_up_proj)
    assert "forward" in vars(lora) and "forward" in vars(lora.get_base_layer())  # the wrapper hands its factors down
    assert "forward" not in vars(model.base_model.model["transposed"])
    layers.end_of_run()
    assert "forward" not in vars(plain) and "forward" not in vars(lora)


class _Recorded(PretrainedLoRA):
    """LoRA on attention and on the fused experts, trained with SGD (its weights after a step are its gradients,
    scaled), the LoRA weights the same in every run; records each step's loss."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder, lr=0.5)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model

        base = self.load_base()
        torch.manual_seed(0)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS)
        self.model = get_peft_model(base, config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _fit(folder: Path, routed: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[_Recorded, int, int]:
    """A 2-step fit, the routed experts on or off; the module, how many experts modules computed from codes, and how
    many routed experts' matmuls from codes added their LoRA factors."""
    installed, with_lora = [], []
    compute, matmul = coded_experts.compute_experts_from_codes, coded_experts._experts_matmul
    monkeypatch.setattr(
        coded_experts, "compute_experts_from_codes", lambda *a: installed.append(compute(*a) if routed else 0)
    )
    # a[3]: the LoRA factors handed down, a[4]: the run's coded layers (None: the weights whole)
    monkeypatch.setattr(coded_experts, "_experts_matmul", lambda *a: with_lora.append(None not in a[3:]) or matmul(*a))
    module = _Recorded(str(folder))
    strategy = lightning_frozen.FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4")
    cpu_trainer(strategy=strategy, max_steps=2, precision="32-true").fit(module, token_data())
    monkeypatch.undo()
    return module, sum(installed), sum(with_lora)


def test_a_moe_fit_on_routed_experts_trains_as_with_experts_decoded_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = moe_folder(tmp_path / "base", "qwen3_moe")
    routed, installed, with_lora = _fit(folder, True, monkeypatch)
    assert installed == 2  # both MoE layers
    assert with_lora > 0  # the LoRA on the experts was computed beside the routed experts, not on a whole decode
    whole, _, _ = _fit(folder, False, monkeypatch)
    assert routed.losses == pytest.approx(whole.losses, rel=1e-6)
    trained = 0
    for (name, param), expected in zip(routed.named_parameters(), whole.parameters()):
        if param.requires_grad:
            trained += "experts" in name
            torch.testing.assert_close(full_param(param), full_param(expected), rtol=1e-5, atol=1e-6, msg=name)
    assert trained == 8  # LoRA A and B of both fused params in both layers


class _Failing(_Recorded):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.losses:  # after a step on the routed experts
            raise RuntimeError("the user's second step failed")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_a_moe_fit_on_routed_experts_leaves_every_forward_as_it_was(tmp_path: Path, ends: str) -> None:
    # the experts modules and PEFT's wrappers around them get a forward of the run's own, taken off when it ends
    from peft.tuners.lora.layer import ParamWrapper
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    folder = moe_folder(tmp_path / "base", "qwen3_moe")
    classes = {cls: cls.forward for cls in (Qwen3MoeExperts, ParamWrapper)}
    module = (_Recorded if ends == "returns" else _Failing)(str(folder))
    seen: list[int] = []
    compute = coded_experts.compute_experts_from_codes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coded_experts, "compute_experts_from_codes", lambda *a: seen.append(compute(*a)) or seen[-1])
        strategy = lightning_frozen.FrozenAwareDeepSpeedStrategy(frozen_dtype="nf4")
        trainer = cpu_trainer(strategy, max_steps=2, precision="32-true")
        if ends == "raises":
            with pytest.raises(RuntimeError, match="second step failed"):
                trainer.fit(module, token_data())
        else:
            trainer.fit(module, token_data())
    assert seen == [2] and len(module.losses) == (2 if ends == "returns" else 1)
    assert [name for name, m in module.named_modules() if "forward" in vars(m)] == []
    assert {cls: cls.forward for cls in classes} == classes
