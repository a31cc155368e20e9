"""The fused GPU path's modules for every family, on the CPU in float64 through gpu_kernels'
reference ops, against the plain (unfused) Hugging Face model.

`fuse_model` is forced on (as in tests/engine/test_packed_step.py), so each family's fused
modules (norm offset, GeGLU, q/k norm inside the rope op, partial rotary, Phi-3's fused
projections, per-layer windows in variable-length attention, Gemma's per-layer-type RoPE tables)
run exactly as on the GPU, with the reference twin of every kernel. The GPU half, the compiled
kernels in bf16, is tests/gpu_kernels/test_gpu_families.py.
"""

from __future__ import annotations

import copy
from itertools import pairwise

import pytest
import torch
from transformers import PreTrainedModel

from gpu_kernels.dispatch import KernelStatus
from tests.engine.tiny_families import WINDOW, build_tiny_family
from tests.gpu_kernels.oracle import give_norm_sources, saved_storages
from worker.engine import fused_model
from worker.engine.families import FAMILIES, layer_attention
from worker.engine.lora import apply_lora, lora_state_dict, trainable_parameters
from worker.engine.types import LoraConfig

ARCHITECTURES = sorted(FAMILIES)
LENGTHS = [14, 17, 9]  # one packed row of 40 tokens; all but the last are longer than a window


@pytest.fixture(scope="module", params=ARCHITECTURES)
def base(request: pytest.FixtureRequest) -> PreTrainedModel:
    model = build_tiny_family(request.param)
    apply_lora(model, LoraConfig(r=4, alpha=8.0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for p in trainable_parameters(model):
            torch.nn.init.normal_(p, std=0.05)  # B nonzero, so the LoRA path matters
    return model.double().train()


@pytest.fixture
def fused(base: PreTrainedModel, monkeypatch: pytest.MonkeyPatch) -> PreTrainedModel:
    monkeypatch.setattr(fused_model.gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))
    model = copy.deepcopy(base)
    report = fused_model.fuse_model(model)
    family = FAMILIES[type(model).__name__]
    layers = model.config.num_hidden_layers
    norms = (4 if family.norm == "sandwich" else 2) * layers + 1  # q/k norms run inside the rope op
    assert not report.skipped, report.skipped
    assert (report.rms_norms, report.qkv_groups, report.attentions, report.mlps) == (
        norms,
        layers,
        layers,
        layers,
    )
    assert fused_model.fused_stack(model.model)
    assert sorted(lora_state_dict(model)) == sorted(lora_state_dict(base))
    return model


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in trainable_parameters(model)
    ]


def _close(got: list[torch.Tensor], want: list[torch.Tensor], rel: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert float((g - w).norm()) <= rel * float(w.norm()) + 1e-12


def test_each_layer_reads_its_family_and_config(fused: PreTrainedModel) -> None:
    family = FAMILIES[type(fused).__name__]
    layers = layer_attention(family, fused.config.to_dict())
    attns = [layer.self_attn for layer in fused.model.layers]
    assert [a.window for a in attns] == [layer.window for layer in layers]
    assert all(isinstance(a, fused_model.FusedAttention) for a in attns)
    if family.windows != "none" and fused.config.sliding_window is not None:
        assert WINDOW in {a.window for a in attns}  # the tiny configs' windows bind
    keys = {a.rope_key for a in attns}
    assert keys == ({"sliding_attention", "full_attention"} if family.rope == "per_layer_type" else {None})
    mlps = [layer.mlp for layer in fused.model.layers]
    assert all(m.activation == family.activation for m in mlps)


def test_fused_loss_and_grads_equal_the_plain_model(base: PreTrainedModel, fused: PreTrainedModel) -> None:
    """Two rows of 24 tokens (windows of 8 bind) through causal_lm_loss vs transformers' loss.
    transformers computes RMSNorm in float32 even in a float64 model: ~1e-7 apart, where a wrong
    offset, activation, norm, window or table is O(1)."""
    plain = copy.deepcopy(base)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :5] = -100
    logits = plain(input_ids=ids, use_cache=False).logits[:, :-1]  # float64 (its .loss is float32)
    expect = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:])
    got = fused_model.causal_lm_loss(fused, ids, labels)
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-8)
    expect.backward()
    got.backward()
    _close(_grads(fused), _grads(plain), 1e-5)


def packed_row(examples: list[torch.Tensor], loss_dtype: torch.dtype) -> fused_model.PackedInputs:
    """One micro-batch of one row holding the examples back to back (positions restart at each),
    every next token of an example a loss target, scale 1."""
    device = examples[0].device
    lengths = [len(e) for e in examples]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    index = torch.tensor([t for a, b in pairwise(starts) for t in range(a, b - 1)], device=device)
    ids = torch.cat(examples).view(1, 1, -1)
    return fused_model.PackedInputs(
        input_ids=ids,
        position_ids=torch.cat([torch.arange(n, device=device) for n in lengths]).view(1, 1, -1),
        cu_seqlens=torch.tensor([starts], dtype=torch.int32, device=device),
        max_seqlen=starts[-1],
        loss_index=index.view(1, -1),
        loss_targets=ids.view(-1)[index + 1].view(1, -1),
        loss_scale=torch.ones((), dtype=loss_dtype, device=device),
    )


def examples_alone(model: torch.nn.Module, examples: list[torch.Tensor]) -> torch.Tensor:
    """Σ over the examples of the summed next-token CE, each run alone through `model` (the
    gradients accumulate); float64 on the CPU, float32 from bf16 logits on the GPU."""
    total = torch.zeros((), dtype=torch.float64, device=examples[0].device)
    for example in examples:
        logits = model(input_ids=example.view(1, -1), use_cache=False).logits[0, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = torch.nn.functional.cross_entropy(logits, example[1:], reduction="sum")
        loss.backward()
        total = total + loss.detach()
    return total


def test_packed_row_equals_each_example_alone(base: PreTrainedModel, fused: PreTrainedModel) -> None:
    """One row holding three examples, through packed_lm_loss (variable-length attention with the
    layers' windows, one RoPE table per layer type read by position), gives the sum of each
    example's loss and gradient through the plain model run on it alone."""
    g = torch.Generator().manual_seed(5)
    examples = [torch.randint(3, 500, (n,), generator=g) for n in LENGTHS]
    got = fused_model.packed_lm_loss(fused, packed_row(examples, torch.float64), 0)
    got.backward()
    plain = copy.deepcopy(base)
    want = examples_alone(plain, examples)
    torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-8)
    _close(_grads(fused), _grads(plain), 1e-5)


def test_the_stack_adds_every_residual_with_its_norm_unless_a_layer_is_checkpointed(
    fused: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fused residual steps a layer (the norm before the MLP; the next layer's or the final
    norm), Gemma's sandwich norm on the sublayer's output inside them: the stack does not quietly
    fall back to each layer's own forward. A checkpointed layer's wrapped forward runs instead,
    with the same loss (bit for bit: the same ops in the same order on the CPU)."""
    from worker.engine.step_memory import apply_checkpointing, remove_checkpointing

    calls: list[bool] = []
    add_rms_norm = fused_model.gpu_kernels.add_rms_norm

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, object]:
        calls.append(len(args) > 5 and args[5] is not None)  # a sandwich norm on the delta
        return add_rms_norm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_model.gpu_kernels, "add_rms_norm", counted)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(4))
    fused_loss = fused_model.causal_lm_loss(fused, ids, ids)
    layers = fused.config.num_hidden_layers
    sandwich = FAMILIES[type(fused).__name__].norm == "sandwich"
    assert calls == [sandwich] * (2 * layers)
    calls.clear()
    assert apply_checkpointing(fused, "full") == layers
    try:
        with torch.no_grad():
            plain_loss = fused_model.causal_lm_loss(fused, ids, ids)
    finally:
        remove_checkpointing(fused)
    assert calls == []
    torch.testing.assert_close(plain_loss, fused_loss.detach(), rtol=1e-12, atol=0)


def test_the_lora_ops_after_a_norm_keep_its_source_and_train_the_same(
    base: PreTrainedModel, fused: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring of gpu_kernels/ops/norm_source.py through the fused stack, on the CPU in fp64:
    the norm is given the NormSource the compiled add_rms_norm returns (its sum and rstd; none for
    a sandwich norm whose sum is formed again), and the LoRA ops are the compiled op's torch code
    (gpu_kernels.ops.lora), which keeps a given source instead of its input. Loss and gradients
    equal the plain model's and those of the same stack without sources; the forward keeps 2
    (tokens, hidden) tensors a layer fewer with pre-norms, 1 with Gemma's sandwich, less the first
    layer's attention norm (its input, the embeddings, is no sum a norm keeps)."""
    give = give_norm_sources(monkeypatch)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(6))
    d = fused.config.hidden_size

    def stream(t: torch.Tensor) -> bool:  # a (tokens, hidden) activation
        return t.dim() > 0 and t.shape[-1] == d and t.numel() == ids.numel() * d

    runs = []
    for sources in (True, False):
        give[0] = sources
        model = copy.deepcopy(fused)
        with saved_storages(stream) as kept:
            loss = fused_model.causal_lm_loss(model, ids, ids)
        loss.backward()
        runs.append((loss.detach(), _grads(model), len(kept)))
    (loss, grads, kept_with), (loss_without, grads_without, kept_without) = runs
    torch.testing.assert_close(loss, loss_without, rtol=1e-12, atol=0)
    _close(grads, grads_without, 1e-10)
    plain = copy.deepcopy(base)
    expect = torch.nn.functional.cross_entropy(
        plain(input_ids=ids, use_cache=False).logits[:, :-1].transpose(1, 2), ids[:, 1:]
    )
    expect.backward()
    torch.testing.assert_close(loss, expect.detach(), rtol=1e-6, atol=1e-8)
    _close(grads, _grads(plain), 1e-5)
    layers = fused.config.num_hidden_layers
    per_layer = 1 if FAMILIES[type(fused).__name__].norm == "sandwich" else 2
    assert kept_without - kept_with == per_layer * layers - 1, (kept_without, kept_with)
