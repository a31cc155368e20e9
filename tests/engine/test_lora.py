"""LoRALinear math against a dense reference, target selection, freezing, state dicts."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from worker.engine.lora import (
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_modules,
    lora_scale,
    lora_state_dict,
    merge_lora,
    remove_lora,
    select_targets,
    trainable_parameters,
)
from worker.engine.models import LoadedModel
from worker.engine.types import ConfigError, LoraConfig

LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def _layer(in_f: int = 16, out_f: int = 24, r: int = 4, scale: float = 2.0, bias: bool = True) -> LoRALinear:
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(in_f, out_f, bias=bias), r=r, scale=scale)
    with torch.no_grad():
        layer.lora_B.normal_()  # B starts at zero; give it values so the update is visible
    return layer


@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_dense_reference(bias: bool) -> None:
    layer = _layer(bias=bias)
    x = torch.randn(3, 5, 16)
    base = layer.base
    assert isinstance(base, nn.Linear)  # a dense base here (a quantized one is a FrozenWeight)
    w = base.weight + layer.scale * layer.lora_B @ layer.lora_A  # (out, in)
    expected = x @ w.T + (base.bias if base.bias is not None else 0)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_fresh_layer_is_the_base_layer_and_a_is_kaiming() -> None:
    base = nn.Linear(64, 32)
    layer = LoRALinear(base, r=8, scale=1.0)
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), base(x))
    assert torch.count_nonzero(layer.lora_B) == 0
    bound = 1 / math.sqrt(64)  # kaiming_uniform(a=√5) on fan_in 64
    assert layer.lora_A.abs().max() <= bound
    assert layer.lora_A.abs().max() > 0.5 * bound
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32


def test_fp32_adapters_on_a_bf16_base() -> None:
    layer = LoRALinear(nn.Linear(16, 8).to(torch.bfloat16), r=4, scale=1.0)
    assert layer.lora_A.dtype == torch.float32
    y = layer(torch.randn(2, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def test_scale_and_rslora() -> None:
    assert lora_scale(LoraConfig(r=16, alpha=32)) == 2.0
    assert lora_scale(LoraConfig(r=16, alpha=32, use_rslora=True)) == 8.0


def test_dropout_applies_only_to_the_adapter_path_in_training() -> None:
    layer = _layer()
    layer.dropout = 0.5
    x = torch.randn(8, 16)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))  # eval: deterministic, no dropout
    layer.train()
    with torch.no_grad():
        layer.lora_B.zero_()  # with B = 0 the adapter path vanishes: training output = base output
    torch.testing.assert_close(layer(x), layer.base(x))


def test_all_linear_targets_every_decoder_linear_never_lm_head(tiny: LoadedModel) -> None:
    model = copy.deepcopy(tiny.model)
    n_layers = model.config.num_hidden_layers
    wrapped = apply_lora(model, LoraConfig(r=4, target_modules="all-linear"))
    assert len(wrapped) == LINEARS_PER_LAYER * n_layers
    assert all(".layers." in name for name in wrapped)
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, LoRALinear)


def test_named_targets_and_path_suffixes(tiny: LoadedModel) -> None:
    model = tiny.model
    assert [n.split(".")[-1] for n in select_targets(model, ["q_proj", "v_proj"])] == ["q_proj", "v_proj"] * 2
    assert len(select_targets(model, ["mlp.down_proj"])) == 2


def test_unknown_target_names_the_field_and_the_name(tiny: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="nope_proj") as err:
        select_targets(tiny.model, ["q_proj", "nope_proj"])
    assert err.value.param == "lora.target_modules"
    with pytest.raises(ConfigError, match="all-linear"):
        select_targets(tiny.model, "everything")


def test_base_frozen_and_gradients_only_on_adapters(tiny: LoadedModel) -> None:
    model = copy.deepcopy(tiny.model)
    apply_lora(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if ".lora_A" in n or ".lora_B" in n}
    assert len(trainable_parameters(model)) == 2 * 2 * 2  # (A, B) x 2 targets x 2 layers
    for p in trainable_parameters(model):
        with torch.no_grad():
            p.normal_(std=0.02)  # non-zero B so that A also gets a gradient
    ids = torch.randint(0, 500, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name
        else:
            assert p.grad is None, name


def test_state_dict_uses_peft_names_and_round_trips(tiny: LoadedModel) -> None:
    model = copy.deepcopy(tiny.model)
    apply_lora(model, LoraConfig(r=4, target_modules=["q_proj"]))
    for p in trainable_parameters(model):
        with torch.no_grad():
            p.normal_()
    state = lora_state_dict(model)
    assert sorted(state) == sorted(
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight"
        for i in range(2)
        for ab in "AB"
    )
    other = copy.deepcopy(tiny.model)
    apply_lora(other, LoraConfig(r=4, target_modules=["q_proj"]))
    load_lora_state_dict(other, state)
    ids = torch.randint(0, 500, (1, 10))
    torch.testing.assert_close(other(input_ids=ids).logits, model(input_ids=ids).logits)

    wrong = copy.deepcopy(tiny.model)
    apply_lora(wrong, LoraConfig(r=4, target_modules=["v_proj"]))
    with pytest.raises(ValueError, match="missing"):
        load_lora_state_dict(wrong, state)


def test_remove_restores_the_base_and_merge_matches_unmerged(tiny: LoadedModel) -> None:
    model = copy.deepcopy(tiny.model)
    originals = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    ids = torch.randint(0, 500, (2, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        apply_lora(model, LoraConfig(r=4))
        for p in trainable_parameters(model):
            p.normal_(std=0.05)
        adapted = model(input_ids=ids).logits
        assert (adapted - before).abs().max() > 1e-3

    merged = copy.deepcopy(model)
    assert merge_lora(merged) == LINEARS_PER_LAYER * 2
    assert not lora_modules(merged)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-4)

    assert remove_lora(model) == LINEARS_PER_LAYER * 2
    assert {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)} == originals
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)
