"""The engine's fused module surgery and captured step, checked on CPU against the plain model.

On CPU `fuse_model` is a no-op (the compiled kernels are not in use); these tests force it on
with a patched status, so the fused modules run on gpu_kernels' reference ops and must compute
exactly what the unfused model computes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from gpu_kernels.dispatch import KernelStatus
from worker.engine import fused_model
from worker.engine.lora import apply_lora, lora_state_dict, remove_lora, trainable_parameters
from worker.engine.models import load_base_model
from worker.engine.train_step import CapturedTrainStep
from worker.engine.types import LoraConfig


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = load_base_model("tiny-llama", store=Path(tmp_path_factory.mktemp("store"))).model
    assert isinstance(model, LlamaForCausalLM)
    apply_lora(model, LoraConfig(r=4, alpha=8))
    for p in trainable_parameters(model):
        torch.nn.init.normal_(p, std=0.05)  # B nonzero, so the LoRA path matters
    return model


@pytest.fixture
def force_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_model.gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))


def test_not_compiled_means_untouched(base: LlamaForCausalLM) -> None:
    model = copy.deepcopy(base)
    report = fused_model.fuse_model(model)
    assert report.rms_norms == report.qkv_groups == report.attentions == report.mlps == 0
    assert "compiled kernels not in use" in report.skipped[0]


def test_fused_model_computes_the_same_loss_and_grads(base: LlamaForCausalLM, force_compiled: None) -> None:
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    report = fused_model.fuse_model(fused)
    layers = fused.config.num_hidden_layers
    counts = (report.rms_norms, report.qkv_groups, report.attentions, report.mlps)
    assert counts == (2 * layers + 1, layers, layers, layers)
    assert all(isinstance(layer.self_attn, fused_model.FusedAttention) for layer in fused.model.layers)
    assert sorted(lora_state_dict(fused)) == sorted(lora_state_dict(plain))
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :4] = -100
    expect = plain(input_ids=ids, labels=labels).loss
    got = fused_model.causal_lm_loss(fused, ids, labels)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)
    expect.backward()
    got.backward()
    for p, q in zip(trainable_parameters(plain), trainable_parameters(fused), strict=True):
        assert q.grad is not None and p.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)


def test_grouped_weights_are_views_and_unwrapping_still_runs(
    base: LlamaForCausalLM, force_compiled: None
) -> None:
    model = copy.deepcopy(base)
    fused_model.fuse_model(model)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj.group
    assert attn.k_proj.base.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    ids = torch.randint(0, 400, (1, 8))
    before = model(input_ids=ids).logits
    remove_lora(model)  # the fused MLP falls back to the plain SwiGLU on unwrapped layers
    after = model(input_ids=ids).logits
    assert after.shape == before.shape and torch.isfinite(after).all()


def test_lm_loss_sum_is_the_plain_sum_on_cpu() -> None:
    head = torch.nn.Linear(8, 13, bias=False)
    h = torch.randn(5, 8)
    t = torch.randint(0, 13, (5,))
    assert torch.equal(
        fused_model.lm_loss_sum(h, head, t), F.cross_entropy(head(h).float(), t, reduction="sum")
    )


def test_captured_step_pads_to_its_budget_and_trains(base: LlamaForCausalLM) -> None:
    model = copy.deepcopy(base)
    model.train()
    params = trainable_parameters(model)
    step = CapturedTrainStep(model, params, batch=2, seq=16, lr=1e-2)
    ids = torch.randint(0, 400, (1, 10), generator=torch.Generator().manual_seed(4))
    losses = [step(ids, ids, 1e-2)["loss"].item() for _ in range(5)]
    assert step.fixed is not None and step.packed is None
    labels = step.fixed[1]
    assert labels[1].eq(-100).all() and labels[0, 10:].eq(-100).all()
    assert losses[-1] < losses[0]
    assert step.graphed.fallback_reason is not None  # CPU: eager, with a reason
    with pytest.raises(ValueError, match="exceeds the captured budget 2x16"):
        step(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64), 1e-2)


def test_fused_attention_takes_the_rope_path_and_falls_back_with_a_mask(
    base: LlamaForCausalLM, force_compiled: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    fused_model.fuse_model(fused)
    calls: list[tuple[int, ...]] = []
    rope = fused_model.gpu_kernels.rope_qkv

    def counting_rope(qkv: torch.Tensor, *args: object) -> tuple[torch.Tensor, ...]:
        calls.append(tuple(qkv.shape))
        return rope(qkv, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_model.gpu_kernels, "rope_qkv", counting_rope)
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(
        fused(input_ids=ids, use_cache=False).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5
    )
    assert len(calls) == fused.config.num_hidden_layers  # one fused RoPE per layer
    # the training loss runs the stack without transformers' mask construction, same loss
    calls.clear()
    labels = ids.clone()
    got = fused_model.causal_lm_loss(fused, ids, labels)
    torch.testing.assert_close(got, plain(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
    assert len(calls) == fused.config.num_hidden_layers
    # a padding mask is not the fast path's business: Hugging Face's forward runs, same result
    calls.clear()
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    torch.testing.assert_close(
        fused(input_ids=ids, attention_mask=mask).logits,
        plain(input_ids=ids, attention_mask=mask).logits,
        rtol=1e-5,
        atol=1e-5,
    )
    assert calls == []


def test_generation_with_a_kv_cache_matches_the_unwrapped_model(
    base: LlamaForCausalLM, force_compiled: None
) -> None:
    """Greedy decoding updates and reads Hugging Face's KV cache under whatever name the installed
    transformers passes it (`cache` from 5.24, `past_key_values` before): the fused attention must
    hand every cached step to Hugging Face's forward, or it would attend to the new token alone."""
    plain, fused = copy.deepcopy(base).eval(), copy.deepcopy(base).eval()
    assert fused_model.fuse_model(fused).attentions == fused.config.num_hidden_layers
    prompt = torch.randint(0, 400, (2, 7), generator=torch.Generator().manual_seed(8))
    settings = {"max_new_tokens": 6, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    with torch.no_grad():
        want = plain.generate(input_ids=prompt, output_scores=True, return_dict_in_generate=True, **settings)
        got = fused.generate(input_ids=prompt, output_scores=True, return_dict_in_generate=True, **settings)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", fused_model.KV_CACHE_ARGS)
def test_a_cache_under_any_name_leaves_the_fast_path(
    base: LlamaForCausalLM, force_compiled: None, name: str
) -> None:
    from transformers.cache_utils import DynamicCache

    model = copy.deepcopy(base)
    fused_model.fuse_model(model)
    attn = model.model.layers[0].self_attn
    assert attn._fast_qkv(None, {}) is not None
    assert attn._fast_qkv(None, {name: DynamicCache()}) is None
    assert attn._fast_qkv(None, {"some_future_name": DynamicCache()}) is None


def test_an_attention_without_the_keywords_is_left_unfused() -> None:
    class OddAttention(torch.nn.Module):
        def forward(self, x: torch.Tensor, cos_sin: object, mask: object) -> torch.Tensor:
            return x

    reason = fused_model.hf_attention_signature_ok(OddAttention())
    assert reason is not None and "hidden_states" in reason
