"""The training recipe on tiny-llama (CPU, fp32): learning, accumulation, callbacks, stop, NaN, limits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.recipe_helpers import Recorder, tiny_config, write_animal_chats
from worker.engine.data import BatchSampler, load_dataset
from worker.engine.lora import lora_modules
from worker.engine.models import LoadedModel
from worker.engine.recipe import LoRAFinetuneRecipe, train
from worker.engine.schedule import lr_factor, warmup_steps
from worker.engine.training_config import plan_steps
from worker.engine.types import (
    ConfigError,
    DatasetError,
    LimitExceeded,
    NonFiniteError,
    StepMetrics,
    TrainConfig,
)


def test_loss_decreases_on_a_tiny_dataset(tmp_path: Path) -> None:
    rec = Recorder()
    config = tiny_config(tmp_path, max_steps=20, validation_file=tmp_path / "train.jsonl", eval_every=10)
    result = train(config, rec)
    assert result.steps == 20 and not result.stopped
    first, last = rec.losses[0], sum(rec.losses[-3:]) / 3
    assert last < first - 0.5, rec.losses
    valid = [m.valid_loss for m in rec.steps if m.valid_loss is not None]
    # every eval_every (10) steps, at each epoch end (8 steps of 4 rows over 32 rows) and at the end
    assert [m.step for m in rec.steps if m.valid_loss is not None] == [8, 10, 16, 20]
    assert valid[-1] < first - 0.5
    assert result.final_valid_loss == valid[-1]
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()


def test_grad_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    """4 rows x 1 micro-batch and 2 rows x 2 micro-batches see the same rows (the sampler's order
    depends only on the seed) and normalise by the same token count: same losses, same adapter."""
    big, small = Recorder(), Recorder()
    r_big = train(tiny_config(tmp_path / "a", batch_size=4, grad_accum=1, max_steps=4), big)
    r_small = train(tiny_config(tmp_path / "b", batch_size=2, grad_accum=2, max_steps=4), small)
    assert big.losses == pytest.approx(small.losses, rel=1e-5, abs=1e-6)
    assert [m.tokens for m in big.steps] == [m.tokens for m in small.steps]
    a = load_file(str(r_big.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(r_small.adapter_dir / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)


def test_packing_is_the_default_and_reports_its_padding(tmp_path: Path, tiny: LoadedModel) -> None:
    """Packed rows (the engine's default) hold several examples: fewer steps on the same real
    tokens, and every step reports the share of its token slots that were padding."""
    assert TrainConfig.__dataclass_fields__["pack"].default is True
    runs = {}
    for pack in (True, False):
        rec = Recorder()
        config = tiny_config(tmp_path / str(pack), pack=pack, max_steps=None, n_epochs=1)
        train(config, rec)
        runs[pack] = (config, rec.steps)
    (config, packed), (_, plain) = runs[True], runs[False]
    assert len(packed) < len(plain)
    assert sum(m.tokens for m in packed) == sum(m.tokens for m in plain)
    data = load_dataset(config.train_file, tiny.tokenizer, config.max_seq_len, pack=True)
    first = BatchSampler(data, config.batch_size, config.seed).batch(0, 0)
    assert packed[0].padding_fraction == pytest.approx(1 - first.num_tokens / first.input_ids.numel())
    assert all(0 <= m.padding_fraction < 1 for m in packed + plain)


def test_callbacks_receive_every_field(tmp_path: Path) -> None:
    rec = Recorder()
    config = tiny_config(
        tmp_path,
        max_steps=6,
        validation_file=tmp_path / "train.jsonl",
        eval_every=4,
        warmup_ratio=0.34,
        lr_scheduler="linear",
        checkpoint_every=2,
    )
    result = train(config, rec)
    assert [m.step for m in rec.steps] == [1, 2, 3, 4, 5, 6]
    total = 0
    warm = warmup_steps(6, 0.34)
    for m in rec.steps:
        assert m.total_steps == 6
        total += m.tokens
        assert m.trained_tokens == total
        assert m.tokens > 0 and m.tokens_per_s > 0 and m.step_seconds > 0
        assert math.isfinite(m.train_loss) and m.grad_norm > 0
        assert m.lr == pytest.approx(5e-3 * lr_factor(m.step - 1, total_steps=6, warmup=warm, kind="linear"))
        assert m.epoch == pytest.approx(m.step * 4 / 32)  # 4 rows per step, 32 rows per epoch
        assert m.eta_seconds >= 0
    assert rec.steps[-1].eta_seconds == 0
    assert [m.valid_loss is not None for m in rec.steps] == [False, False, False, True, False, True]
    assert result.trained_tokens == total
    assert [c.step for c in rec.checkpoints] == [2, 4, 6]
    assert [c.step for c in result.checkpoints] == [2, 4, 6]
    # should_stop() asked before every step, and after each chunk tokenized (one a file here)
    assert rec.stop_checks == 6 + 2
    assert any("trainable parameters" in msg for _, msg in rec.events)


def test_should_stop_ends_the_run_with_a_checkpoint(tmp_path: Path) -> None:
    rec = Recorder(stop_after=3)
    result = train(tiny_config(tmp_path, max_steps=10), rec)
    assert result.stopped and result.steps == 3
    assert [m.step for m in rec.steps] == [1, 2, 3]
    ckpt = tmp_path / "out" / "checkpoints" / "step-000003"
    assert [c.path for c in rec.checkpoints] == [ckpt]
    assert result.adapter_dir == ckpt and (ckpt / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "out" / "adapter").exists()  # no "final" adapter for a stopped run


def test_should_stop_is_asked_while_the_data_is_tokenized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop asked for while the data is prepared ends the run there: no step, no checkpoint."""
    from worker.engine import data

    monkeypatch.setattr(data, "CHUNK_LINES", 8)  # the 32 lines in 4 chunks

    class StopAtThirdChunk(Recorder):
        def should_stop(self) -> bool:
            super().should_stop()
            return self.stop_checks == 3

    rec = StopAtThirdChunk()
    result = train(tiny_config(tmp_path, max_steps=10), rec)
    assert result.stopped and result.steps == 0 and result.trained_tokens == 0
    assert rec.stop_checks == 3 and rec.steps == [] and rec.checkpoints == []
    assert ("info", "Stop requested: stopped while tokenizing train.jsonl") in rec.events
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_non_finite_loss_names_the_step_and_saves_nothing(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, max_steps=6, checkpoint_every=2)
    rec = Recorder()

    class Poison(Recorder):
        """After step 2 (checkpointed), a diverged adapter: one LoRA weight becomes inf."""

        def on_step(self, metrics: StepMetrics) -> None:
            rec.on_step(metrics)
            if metrics.step == 2:
                layer = next(iter(lora_modules(recipe.model).values()))
                with torch.no_grad():
                    layer.lora_B[0, 0] = float("inf")

    recipe = LoRAFinetuneRecipe(config, Poison())
    recipe.setup()
    try:
        with pytest.raises(NonFiniteError, match="step 3") as err:
            recipe.train()
    finally:
        recipe.cleanup()
    assert err.value.step == 3
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert checkpoints == ["step-000002"]  # the last good one; nothing written after the NaN
    assert not (tmp_path / "out" / "adapter").exists()
    # step 3 is reported (its loss is NaN, a gap on the chart) but never applied or saved
    assert [m.step for m in rec.steps] == [1, 2, 3] and math.isnan(rec.steps[-1].train_loss)


def test_max_tokens_limit_checkpoints_then_fails(tmp_path: Path) -> None:
    rec = Recorder()
    with pytest.raises(LimitExceeded, match="max_tokens 200"):
        train(tiny_config(tmp_path, max_steps=10, max_tokens=200), rec)
    assert len(rec.steps) < 10
    assert [c.step for c in rec.checkpoints] == [len(rec.steps)]


def test_step_limit_fails_before_training(tmp_path: Path) -> None:
    rec = Recorder()
    # 32 rows / batch 4 = 8 steps per epoch; 2 epochs = 16 steps > 10
    with pytest.raises(LimitExceeded, match="needs 16 optimizer steps, over the step limit of 10") as err:
        train(tiny_config(tmp_path, max_steps=None, n_epochs=2, step_limit=10), rec)
    assert err.value.code == "limit_exceeded"
    assert rec.steps == [] and not (tmp_path / "out" / "checkpoints").exists()
    at_limit = tiny_config(tmp_path / "ok", max_steps=None, n_epochs=2, step_limit=16)
    assert train(at_limit, Recorder()).steps == 16


def test_reused_model_is_left_pristine(tmp_path: Path, tiny: LoadedModel) -> None:
    before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    ids = torch.randint(0, 500, (1, 8))
    with torch.no_grad():
        logits_before = tiny.model(input_ids=ids).logits
    for run in ("one", "two"):
        result = train(tiny_config(tmp_path / run, max_steps=2), Recorder(), loaded=tiny)
        assert result.steps == 2
        assert not lora_modules(tiny.model)
    after = tiny.model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    with torch.no_grad():
        torch.testing.assert_close(tiny.model(input_ids=ids).logits, logits_before)
    assert not tiny.model.training


def test_preloaded_model_must_be_the_configured_one(tmp_path: Path, tiny: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="preloaded model"):
        train(tiny_config(tmp_path, model="llama-1b"), Recorder(), loaded=tiny)


def test_epochs_mode_counts_steps_from_the_data(tmp_path: Path) -> None:
    rec = Recorder()
    # 32 rows / batch 4 = 8 micro-batches per epoch; 2 epochs, accumulation 3 -> ceil(16 / 3) = 6 steps
    result = train(tiny_config(tmp_path, max_steps=None, n_epochs=2, grad_accum=3), rec)
    assert result.steps == 6
    assert rec.steps[-1].epoch == pytest.approx(2.0)
    assert rec.steps[-1].trained_tokens == sum(m.tokens for m in rec.steps)


def test_plan_steps_counts_optimizer_steps_of_grad_accum_micro_batches() -> None:
    # the arithmetic the run above and a dry run (service/dry_run.py) share
    plan = plan_steps(32, batch_size=4, n_epochs=2, grad_accum=3)
    assert (plan.micro_batches_per_epoch, plan.micro_batches, plan.steps) == (8, 16, 6)
    assert (
        plan_steps(33, batch_size=4, n_epochs=1, grad_accum=1).micro_batches_per_epoch == 9
    )  # a short last batch
    assert plan_steps(32, batch_size=4, n_epochs=9, grad_accum=2, max_steps=5).steps == 5


def test_max_wall_seconds_limit_checkpoints_then_fails(tmp_path: Path) -> None:
    rec = Recorder()
    with pytest.raises(LimitExceeded, match="max_wall_seconds") as err:
        train(tiny_config(tmp_path, max_steps=10, max_wall_seconds=1e-3), rec)
    assert err.value.code == "limit_exceeded"
    assert [m.step for m in rec.steps] == [1]
    assert (tmp_path / "out" / "checkpoints" / "step-000001" / "adapter_model.safetensors").is_file()


def test_bad_validation_file_is_reported_as_such(tmp_path: Path) -> None:
    bad = tmp_path / "valid.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    with pytest.raises(DatasetError) as err:
        train(tiny_config(tmp_path, validation_file=bad), Recorder())
    assert err.value.param == "validation_file"
    assert [e.line for e in err.value.errors] == [1, 2]


def test_checkpoints_at_epoch_ends_and_by_training_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint at every epoch end, and once `checkpoint_interval_seconds` of
    training passed since the last one (whichever comes first), so a lost worker loses at most that."""
    import worker.engine.recipe as recipe

    # 8 examples, batch 4: 2 steps an epoch, 3 epochs
    config = tiny_config(tmp_path / "epochs", max_steps=None, n_epochs=3, checkpoint_each_epoch=True)
    write_animal_chats(config.train_file, n=8)
    rec = Recorder()
    train(config, rec)
    assert [c.step for c in rec.checkpoints] == [2, 4, 6]  # epoch ends; 6 is also the last step

    # A clock that advances 4 "seconds" per reading: with an interval of 10 s a checkpoint is due
    # every few steps although no epoch ended (32 examples: 8 steps an epoch, max_steps 6).
    clock = iter(range(0, 100_000, 4))
    monkeypatch.setattr(recipe.time, "monotonic", lambda: float(next(clock)))
    timed = tiny_config(tmp_path / "timed", checkpoint_interval_seconds=10.0)
    rec = Recorder()
    train(timed, rec)
    steps = [c.step for c in rec.checkpoints]
    assert steps[-1] == 6 and len(steps) >= 3, steps
    assert all(b - a <= 3 for a, b in zip([0, *steps], steps, strict=False)), steps
