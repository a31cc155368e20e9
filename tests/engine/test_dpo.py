"""DPO (issue 33, point 3) on the CPU in float64, against an independent implementation of the
formula on tiny-llama: each sequence run alone through the plain Hugging Face model (full logits,
log-softmax, gather), the reference from a copy of the base without LoRA, the loss
mean(-log σ(β((π_w - ref_w) - (π_l - ref_l)))) + α · (the chosen answers' token NLLs, a mean over
all their tokens: TRL's "sft" term, its rpo_alpha) and its LoRA gradients by autograd.

Ours: the recipe's eager step (Hugging Face forward, pairs one per row or packed several a row,
over two micro-batches) and the captured step's `PreferenceObjective` (fused modules forced on
with gpu_kernels' reference ops, packed rows, variable-length attention), with the reference
log-probabilities from the pre-pass that switches the adapter off.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from gpu_kernels.dispatch import KernelStatus
from tests.engine.recipe_helpers import Recorder
from worker.engine import fused_model
from worker.engine.data import IGNORE_INDEX, BatchSampler, load_dataset, read_valid_examples
from worker.engine.lora import apply_lora, remove_lora, trainable_parameters
from worker.engine.models import LoadedModel, load_base_model
from worker.engine.preference import (
    LOG2,
    PreferenceObjective,
    adapters_off,
    batch_logps,
    chosen_tokens,
    eager_loss,
    host_pairs,
    reference_table,
)
from worker.engine.recipe import train
from worker.engine.train_step import CapturedTrainStep, StepShape, host_step
from worker.engine.training_config import DpoTraining
from worker.engine.types import ConfigError, LoraConfig, TrainConfig

BETA = 0.3
RPO_ALPHA = 0.7  # the NLL term's weight where a test takes one (not 1, so a missing α would show)
ANIMALS = ["cat", "dog", "bird", "fish", "horse", "cow", "sheep", "goat"]


def pair(i: int) -> dict[str, Any]:
    a = ANIMALS[i % len(ANIMALS)]
    return {
        "input": {"messages": [{"role": "user", "content": f"what is the {a}?" + " really" * (i % 3)}]},
        "preferred_output": [{"role": "assistant", "content": f"the {a} is an animal."}],
        "non_preferred_output": [{"role": "assistant", "content": f"no idea{'!' * (i % 4)}"}],
    }


def write_pairs(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps(pair(i)) + "\n" for i in range(n)))
    return path


def dpo_config(tmp: Path, **overrides: Any) -> TrainConfig:
    """A small CPU DPO run of tiny-llama (one pair a row); `overrides` replace its fields."""
    values: dict[str, Any] = {
        "model": "tiny-llama",
        "output_dir": tmp / "out",
        "model_store": tmp / "models",
        "lora": LoraConfig(r=4, alpha=8.0),
        "max_seq_len": 128,
        "batch_size": 2,
        "learning_rate": 1e-2,
        "seed": 1,
        "device": "cpu",
        "pack": False,
        "method": DpoTraining(beta=0.1),
        **overrides,
    }
    return TrainConfig(**values)


@pytest.fixture(scope="module")
def tiny_fp64(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    loaded = load_base_model("tiny-llama", store=Path(tmp_path_factory.mktemp("store")))
    model = loaded.model
    assert isinstance(model, LlamaForCausalLM)
    torch.manual_seed(0)
    apply_lora(model, LoraConfig(r=4, alpha=8))
    model.double()
    for p in trainable_parameters(model):
        torch.nn.init.normal_(p, std=0.05)  # B nonzero: the policy differs from the reference
    return loaded


def no_autocast() -> torch.autocast:
    return torch.autocast(device_type="cpu", enabled=False)


def formula(
    policy: torch.nn.Module, examples: list[tuple[list[int], list[int], int]], rpo_alpha: float = 0.0
) -> tuple[torch.Tensor, float]:
    """The DPO loss by the paper's formula, each sequence alone, full logits; the reference a
    copy of the base without LoRA (no code of worker.engine.preference involved); plus rpo_alpha ×
    the chosen answers' NLL as TRL takes it: -(their trained tokens' log-probs).mean(), all the
    pairs' tokens at once. Also that NLL's value."""
    base = copy.deepcopy(policy)
    remove_lora(base)

    def token_lps(model: torch.nn.Module, ids: list[int], labels: list[int]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # (T, V)
        lp = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(labels[1:])
        keep = target != IGNORE_INDEX
        return lp[keep].gather(1, target[keep][:, None])[:, 0]  # (trained tokens,)

    losses, chosen_lps = [], []
    for ids, labels, split in examples:
        chosen, rejected = (ids[:split], labels[:split]), (ids[split:], labels[split:])
        with torch.no_grad():
            ref_w, ref_l = token_lps(base, *chosen).sum(), token_lps(base, *rejected).sum()
        policy_w = token_lps(policy, *chosen)
        chosen_lps.append(policy_w)
        margin = (policy_w.sum() - ref_w) - (token_lps(policy, *rejected).sum() - ref_l)
        losses.append(-F.logsigmoid(BETA * margin))
    nll = -torch.cat(chosen_lps).mean()
    return torch.stack(losses).mean() + rpo_alpha * nll, float(nll.detach())


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in trainable_parameters(model)]  # type: ignore[union-attr]


def assert_close_rel(ours: list[torch.Tensor], theirs: list[torch.Tensor], rel: float = 1e-6) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert float((a - b).norm() / b.norm()) < rel


@pytest.mark.parametrize(
    ("pack", "rows", "rpo_alpha"),
    [(False, 2, 0.0), (True, 1, 0.0), (False, 2, RPO_ALPHA), (False, 6, RPO_ALPHA), (True, 1, RPO_ALPHA)],
    ids=["one-pair-a-row", "packed", "rpo", "rpo-one-micro-batch", "rpo-packed"],
)
def test_eager_step_equals_the_formula(
    tiny_fp64: LoadedModel, tmp_path: Path, pack: bool, rows: int, rpo_alpha: float
) -> None:
    """Loss and LoRA gradients of one optimizer step of 6 pairs in micro-batches of `rows` rows,
    within 1e-6 relative of the formula over the 6 pairs at once, with and without the chosen
    answers' NLL (rpo_alpha): micro-batches of 2 pairs (or packed rows of one, 2 micro-batches),
    whose pairs' and chosen tokens' counts differ, accumulate to the one large batch; packed rows
    equal one pair a row."""
    data = load_dataset(write_pairs(tmp_path / "p.jsonl", 6), tiny_fp64.tokenizer, 256, pack=pack)
    assert data.packed and (len(data) < 6) == pack
    model = copy.deepcopy(tiny_fp64.model)

    def logps(batch: Any) -> torch.Tensor:
        return batch_logps(model, batch, no_autocast)

    table = reference_table(model, data, 2, logps)
    sampler = BatchSampler(data, rows, seed=0, shuffle=False)
    micro = [sampler.batch(0, i) for i in range(len(sampler))]
    assert (len(micro) == 1) == (rows == 6)  # else 2 or 3 micro-batches
    step_pairs, step_chosen = 6, sum(chosen_tokens(b) for b in micro)
    total = torch.zeros((), dtype=torch.float64)
    nll = 0.0
    for batch in micro:
        loss, readings = eager_loss(
            logps(batch), table.for_batch(batch), BETA, rpo_alpha, step_pairs, step_chosen
        )
        loss.backward()
        total += loss.detach()
        nll += float(readings[3])
    examples, _ = read_valid_examples(tmp_path / "p.jsonl", tiny_fp64.tokenizer, 256)
    oracle_model = copy.deepcopy(tiny_fp64.model)
    expected, expected_nll = formula(
        oracle_model, [(*examples.tokens_of(i), examples.split(i)) for i in range(6)], rpo_alpha
    )
    expected.backward()
    assert float(total) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert nll == pytest.approx(expected_nll, rel=1e-6)  # the NLL reading, α or not
    assert_close_rel(grads_of(model), grads_of(oracle_model))


def test_adapters_off_is_the_base(tiny_fp64: LoadedModel) -> None:
    model = copy.deepcopy(tiny_fp64.model)
    base = copy.deepcopy(model)
    remove_lora(base)
    ids = torch.tensor([[5, 9, 33, 70, 2]])
    with torch.no_grad(), adapters_off(model):
        off = model(input_ids=ids).logits
    with torch.no_grad():
        on = model(input_ids=ids).logits
    torch.testing.assert_close(off, base(input_ids=ids).logits, rtol=0, atol=0)
    assert float((on - off).abs().max()) > 1e-3  # and the adapter is back on after it


@pytest.mark.parametrize("rpo_alpha", [0.0, RPO_ALPHA], ids=["dpo", "rpo"])
def test_captured_step_objective_equals_the_formula(
    tiny_fp64: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rpo_alpha: float
) -> None:
    """The captured step's machinery (fused modules with the reference ops, packed rows,
    cu_seqlens, gathered loss positions, static buffers) with PreferenceObjective: one step of 6
    pairs in 2 micro-batches, loss, NLL reading and gradients (max_grad_norm out of the way, lr 0)
    equal the formula's, with and without the chosen answers' NLL."""
    monkeypatch.setattr(fused_model.gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))
    model = copy.deepcopy(tiny_fp64.model)
    fused_model.fuse_model(model)
    assert fused_model.fused_stack(model.model)
    data = load_dataset(write_pairs(tmp_path / "p.jsonl", 6), tiny_fp64.tokenizer, 128, pack=True)
    table = reference_table(model, data, 1, lambda b: batch_logps(model, b, no_autocast))
    sampler = BatchSampler(data, 1, seed=0, shuffle=False)
    micro = [sampler.batch(0, i) for i in range(len(sampler))]
    assert len(micro) >= 2
    rows, seq = 1, data.max_seq_len
    shape = StepShape(len(micro), rows, seq, segments=16, loss_tokens=rows * seq, pairs=6)
    params = trainable_parameters(model)
    objective = PreferenceObjective(BETA, rpo_alpha)
    step = CapturedTrainStep(
        model,
        params,
        batch=rows,
        seq=seq,
        lr=0.0,
        max_grad_norm=1e9,
        shape=shape,
        warmup=1,
        objective=objective,
    )
    host = host_step(micro, shape)
    host.pairs = host_pairs(micro, host.loss_index, shape.micro_batches, shape.pairs, rows, seq, table)
    assert host.pairs.pairs == 6 and host.divisor == 6
    assert host.pairs.chosen_tokens == sum(chosen_tokens(b) for b in micro) > 6
    step.load_step(host)
    out = step.run()
    examples, _ = read_valid_examples(tmp_path / "p.jsonl", tiny_fp64.tokenizer, 128)
    oracle_model = copy.deepcopy(tiny_fp64.model)
    expected, expected_nll = formula(
        oracle_model, [(*examples.tokens_of(i), examples.split(i)) for i in range(6)], rpo_alpha
    )
    expected.backward()
    assert float(out["loss"]) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert_close_rel(grads_of(model), grads_of(oracle_model))
    assert out["readings"].shape == (4,)
    assert float(out["readings"][3]) == pytest.approx(expected_nll, rel=1e-6)


def test_dpo_run_reports_its_curves_and_refuses_supervised_data(tmp_path: Path, tiny: LoadedModel) -> None:
    """A DPO job's recipe on tiny-llama (fp32, eager), rpo_alpha left at auto (1): the first step's
    loss is log 2 + the chosen answers' NLL (the adapter starts at B = 0, so the policy is the
    reference and the DPO term log 2), every step reports rewards, margin, accuracy and that NLL,
    the held-out pairs give a validation loss with their own readings, and the margin grows while
    the NLL falls; a chat file is refused naming the method."""
    train_file = write_pairs(tmp_path / "pairs.jsonl", 12)
    rec = Recorder()
    config = dpo_config(
        tmp_path,
        train_file=train_file,
        lora=LoraConfig(r=8, alpha=16.0),
        n_epochs=1,
        learning_rate=2e-2,
        eval_every=3,
        validation_file=write_pairs(tmp_path / "valid.jsonl", 4),
    )
    result = train(config, rec, loaded=tiny)
    assert result.steps == len(rec.steps) > 4 and not result.stopped
    first = rec.steps[0]
    assert first.preference is not None and first.preference.accuracy == 0.0  # r_w == r_l == 0
    assert first.preference.chosen_nll is not None and first.preference.chosen_nll > 0.5
    assert first.train_loss == pytest.approx(LOG2 + first.preference.chosen_nll, abs=1e-5)
    assert all(s.preference is not None for s in rec.steps)
    validated = [s for s in rec.steps if s.valid_loss is not None]
    assert validated and all(s.valid_preference is not None for s in validated)
    for s in validated:  # the validation loss is the train loss's formula: DPO + 1 × NLL
        assert s.valid_preference is not None and s.valid_preference.chosen_nll is not None
        assert s.valid_loss is not None and s.valid_loss > s.valid_preference.chosen_nll
    last = rec.steps[-1].preference
    assert last is not None and last.margin > 0.05 and last.accuracy > 0.5
    assert math.isclose(last.margin, last.chosen_reward - last.rejected_reward, rel_tol=1e-9)
    assert last.chosen_nll is not None and last.chosen_nll < first.preference.chosen_nll
    assert rec.steps[-1].train_loss < first.train_loss
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    with pytest.raises(ConfigError, match="needs preference pairs"):
        train(
            TrainConfig(**{**config.__dict__, "train_file": chats, "output_dir": tmp_path / "o2"}), Recorder()
        )


def test_memory_plan_passes_train_like_whole_micro_batches(tmp_path: Path, tiny: LoadedModel) -> None:
    """A DPO step in the memory plan's passes of one row (each pair alone, activations offloaded)
    trains like the whole micro-batch: the step's loss divides by the step's pairs either way."""
    from worker.engine.memory_plan import MemoryChoice

    def losses(memory: MemoryChoice | None, out: str) -> list[float]:
        rec = Recorder()
        config = dpo_config(
            tmp_path,
            train_file=write_pairs(tmp_path / "pairs.jsonl", 6),
            output_dir=tmp_path / out,
            batch_size=3,
            max_steps=2,
            seed=2,
            method=DpoTraining(beta=0.2),
            memory=memory,
        )
        train(config, rec, loaded=tiny)
        return [s.train_loss for s in rec.steps]

    whole = losses(None, "whole")
    passes = losses(MemoryChoice(micro_rows=1, offload=True), "passes")
    assert whole[0] > LOG2 + 0.5  # the DPO term's log 2 and the chosen answers' NLL (rpo_alpha auto)
    assert passes == pytest.approx(whole, rel=1e-5)


def test_a_checkpoint_resumes_only_its_own_method(tmp_path: Path) -> None:
    """A DPO checkpoint never resumes a supervised run (nor one of another beta); a checkpoint
    written before the method was recorded is a supervised run's."""
    from worker.engine.checkpoint import TRAINER_STATE, TRAINING_STATE, check_resumable
    from worker.engine.export import ADAPTER_WEIGHTS

    def checkpoint(config: dict[str, Any]) -> Path:
        path = tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        (path / ADAPTER_WEIGHTS).write_bytes(b"")
        (path / TRAINING_STATE).write_bytes(b"")
        (path / TRAINER_STATE).write_text(json.dumps({"config": config}))
        return path

    sft = TrainConfig(model="tiny-llama", train_file=tmp_path, output_dir=tmp_path, model_store=tmp_path)
    dpo = TrainConfig(**{**sft.__dict__, "method": DpoTraining(beta=0.1)})
    check_resumable(checkpoint(dpo.to_dict()), dpo)
    with pytest.raises(ConfigError, match="method was"):
        check_resumable(checkpoint(dpo.to_dict()), sft)
    with pytest.raises(ConfigError, match="method was"):
        check_resumable(
            checkpoint(dpo.to_dict()), TrainConfig(**{**sft.__dict__, "method": DpoTraining(beta=0.2)})
        )
    with pytest.raises(ConfigError, match="method was"):
        check_resumable(
            checkpoint(dpo.to_dict()),
            TrainConfig(**{**sft.__dict__, "method": DpoTraining(beta=0.1, rpo_alpha=0)}),
        )
    older = {k: v for k, v in sft.to_dict().items() if k != "method"}
    check_resumable(checkpoint(older), sft)
    with pytest.raises(ConfigError, match="method was"):
        check_resumable(checkpoint(older), dpo)
    # a DPO checkpoint from before rpo_alpha trained DPO alone: it resumes rpo_alpha 0 only
    before = {**dpo.to_dict(), "method": {"type": "dpo", "beta": 0.1}}
    check_resumable(
        checkpoint(before), TrainConfig(**{**sft.__dict__, "method": DpoTraining(beta=0.1, rpo_alpha=0)})
    )
    with pytest.raises(ConfigError, match="method was"):
        check_resumable(checkpoint(before), dpo)


def test_a_local_run_takes_the_method_from_its_config_file(tmp_path: Path) -> None:
    """`loraq train` YAML: `method: {type: dpo, beta: ...}` reaches the engine's config typed; a bad
    beta or type is an error naming the field."""
    from worker.engine.config_file import config_from_mapping

    base = {"model": "tiny-llama", "train_file": "p.jsonl", "output_dir": "out", "model_store": "m"}
    config = config_from_mapping({**base, "method": {"type": "dpo", "beta": 0.25}}, base_dir=tmp_path)
    assert config.method == DpoTraining(beta=0.25)
    assert isinstance(config.method, DpoTraining) and config.method.rpo_alpha_value == 1.0  # auto
    rpo = config_from_mapping({**base, "method": {"type": "dpo", "rpo_alpha": 0}}, base_dir=tmp_path)
    assert rpo.method == DpoTraining(rpo_alpha=0.0)
    for bad_alpha in (-0.5, "high", True):
        with pytest.raises(ConfigError) as bad_rpo:
            config_from_mapping(
                {**base, "method": {"type": "dpo", "rpo_alpha": bad_alpha}}, base_dir=tmp_path
            )
        assert bad_rpo.value.field.startswith("method")
    assert config_from_mapping(base, base_dir=tmp_path).method.type == "supervised"
    with pytest.raises(ConfigError) as bad:
        config_from_mapping({**base, "method": {"type": "dpo", "beta": -1}}, base_dir=tmp_path)
    assert bad.value.field.startswith("method")
    with pytest.raises(ConfigError) as unknown:
        config_from_mapping({**base, "method": {"type": "reinforcement"}}, base_dir=tmp_path)
    assert unknown.value.field.startswith("method")
