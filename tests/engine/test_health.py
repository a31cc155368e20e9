"""Training tells you when it went wrong: each health case driven on the CPU tiny model.

tiny-llama's loss can neither blow up nor fall near zero, so the fixture makes it a small
"pretrained" model first (`recipe_helpers.build_pretrained_tiny`: `tiny-pretrained`). On that model:
- learning rate ×500 → the loss leaves its first value ×3 → `DivergedError` (code `diverged`);
- training "the X is a plant." while validating on the animal answers it knew → the validation
  loss rises while the train loss falls (overfitting), and the train loss drops under 0.05
  (memorizing);
and on tiny-llama, a learning rate of 1e-9 leaves the loss flat (nothing trained).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.engine.recipe_helpers import (
    ANIMALS,
    Recorder,
    build_pretrained_tiny,
    tiny_config,
    write_animal_chats,
)
from worker.engine.health import DPO_MEMORIZE_BELOW, LN2, RULES, HealthMonitor, dpo_rules
from worker.engine.recipe import train
from worker.engine.types import DivergedError, NonFiniteError


@pytest.fixture(scope="module")
def pretrained_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("health")
    build_pretrained_tiny(tmp / "models", tmp)
    return tmp / "models"


def health_events(rec: Recorder) -> list[tuple[str, dict[str, object]]]:
    return [(msg, data) for level, msg, data in rec.full_events if level == "warn" and data]


# --------------------------------------------------------------------------- the monitor alone


def test_monitor_rules() -> None:
    m = HealthMonitor(warmup_steps=2)
    assert m.check_step(1, 2.0) == []
    assert m.check_step(2, 7.0) == []  # still warming up: a spike is allowed
    with pytest.raises(DivergedError, match=r"step 3: train loss 6.1 is over 3x its first value 2") as e:
        m.check_step(3, 6.1)
    assert e.value.code == "diverged" and "lower the learning rate" in str(e.value)
    with pytest.raises(NonFiniteError):
        HealthMonitor().check_step(1, float("nan"))

    flat = HealthMonitor()
    for step in range(1, 11):
        flat.check_step(step, 3.0 + 0.001 * (step % 2))
    (finding,) = flat.check_progress(10)
    assert finding.kind == "not_training" and finding.data() == {"health": "not_training", "step": 10}
    assert flat.check_progress(11) == []  # once per run

    over = HealthMonitor()
    for step, (train_loss, valid) in enumerate([(3.0, 2.0), (2.0, 2.1), (1.0, 2.2)], start=1):
        over.check_step(step, train_loss)
        findings = over.check_eval(step, valid)
    assert [f.kind for f in findings] == ["overfitting"]


def test_dpo_rules_measure_the_preference_loss_from_ln_2() -> None:
    """A DPO loss starts at ln 2 and falls to 0 only as the reward margin grows: 0.03 (a margin of
    about 3.5) is a healthy run that the cross-entropy rule would call memorizing; a mean under
    -log σ(5) over 5 steps is memorizing. Divergence and "nothing trained" count from ln 2."""
    sft, dpo = HealthMonitor(), HealthMonitor(method="dpo")
    said: dict[str, list[str]] = {"sft": [], "dpo": []}
    for step, loss in enumerate([LN2, 0.4, 0.1, 0.03, 0.03, 0.03, 0.03, 0.03], start=1):
        said["sft"] += [f.kind for f in sft.check_step(step, loss)]
        said["dpo"] += [f.kind for f in dpo.check_step(step, loss)]
    assert said == {"sft": ["memorizing"], "dpo": []}
    findings = [f for step in range(9, 14) for f in dpo.check_step(step, 0.005)]
    assert [(f.kind, f.step) for f in findings] == [("memorizing", 13)]
    assert findings[0].message.startswith("Memorizing: DPO loss 0.0050 < 0.0067 at step 13")
    assert "implicit reward margin over 5" in findings[0].message
    assert pytest.approx(-math.log(1 / (1 + math.exp(-5.0)))) == DPO_MEMORIZE_BELOW  # -log σ(5)

    # a first step below ln 2 (dropout) does not lower DPO's bar: 3 ln 2 = 2.08 is
    early = HealthMonitor(warmup_steps=1, method="dpo")
    early.check_step(1, 0.5)
    assert early.check_step(2, 2.0) == []
    with pytest.raises(DivergedError, match=r"DPO loss 2.1 is over 3x where every run starts, 0.6931"):
        early.check_step(3, 2.1)
    sft_early = HealthMonitor(warmup_steps=1)  # the supervised bar stands on the first step
    sft_early.check_step(1, 0.5)
    with pytest.raises(DivergedError, match=r"train loss 2 is over 3x its first value 0\.5"):
        sft_early.check_step(2, 2.0)

    # learnt within the first fifth, then level: the supervised rule (first fifth -> last fifth)
    # says nothing trained, DPO's (ln 2 -> last fifth) sees the drop; level at ln 2 is flat
    level_sft, level_dpo, at_start = HealthMonitor(), HealthMonitor(method="dpo"), HealthMonitor(method="dpo")
    for step in range(1, 11):
        level_sft.check_step(step, 0.3)
        level_dpo.check_step(step, 0.3)
        at_start.check_step(step, LN2 - 0.001)
    assert [f.kind for f in level_sft.check_progress(10)] == ["not_training"]
    assert level_dpo.check_progress(10) == []
    (flat,) = at_start.check_progress(10)
    assert flat.kind == "not_training" and "near ln 2" in flat.message
    assert flat.message.startswith("Nothing trained: DPO loss flat over 10 steps (0.6931 -> 0.6921)")


def test_dpo_rules_with_the_nll_term_start_at_ln_2_plus_alpha_nll() -> None:
    """With rpo_alpha α, the loss DPO + α · NLL starts at ln 2 + α · NLL₀ (the base's NLL of the
    chosen answers): divergence, "nothing trained" and memorizing count from there; α 0 is DPO's
    rules unchanged."""
    assert dpo_rules(0.0, 2.0) == RULES["dpo"]
    rules = dpo_rules(1.0, 2.0)
    start = LN2 + 2.0
    assert rules.start == pytest.approx(start)
    # a run at its start, then down by 0.5 nats: trained; DPO's bare rules would call it diverged
    # (2.69 is over 3 ln 2) and the level one flat
    run, bare = HealthMonitor(method="dpo", rules=rules), HealthMonitor(method="dpo")
    run.check_step(1, start)
    with pytest.raises(DivergedError):
        for step in range(2, 4):
            bare.check_step(step, start)
    for step in range(2, 11):
        assert run.check_step(step, start - 0.5) == []
    assert run.check_progress(10) == []
    # level at its start: nothing trained, said from ln 2 + α · NLL₀
    level = HealthMonitor(method="dpo", rules=rules)
    for step in range(1, 11):
        level.check_step(step, start - 0.001)
    (flat,) = level.check_progress(10)
    assert flat.message.startswith("Nothing trained: DPO + NLL loss flat over 10 steps (2.6931 -> 2.6921)")
    # over 3x the start: diverged
    with pytest.raises(DivergedError, match=r"DPO \+ NLL loss 8.1 is over 3x where every run starts, 2.693"):
        run.check_step(11, 8.1)
    # memorizing below DPO's bar + α · 0.05: a DPO term of 0.03 with an NLL of 0.02 (reciting the
    # chosen answers); 0.1 (a healthy DPO term, NLL 0.07) is not
    recite = HealthMonitor(method="dpo", rules=dpo_rules(1.0, 2.0))
    said = [f.kind for step in range(1, 6) for f in recite.check_step(step, 0.1)]
    said += [f.kind for step in range(6, 11) for f in recite.check_step(step, 0.05)]
    assert said == ["memorizing"]


# --------------------------------------------------------------------------- on the tiny model


def test_divergence_fails_with_code_and_hint(pretrained_store: Path, tmp_path: Path) -> None:
    rec = Recorder()
    config = tiny_config(
        tmp_path, model="tiny-pretrained", model_store=pretrained_store, max_steps=20, learning_rate=0.1,
        checkpoint_every=1,
    )  # fmt: skip
    with pytest.raises(DivergedError) as err:
        train(config, rec)
    assert err.value.code == "diverged" and err.value.param == "hyperparameters.learning_rate_multiplier"
    assert "over 3x its first value" in str(err.value) and "lower the learning rate" in str(err.value)
    # stopped before the optimizer applied the diverged step: no checkpoint of it, no adapter; the
    # step itself is reported, so the chart shows the jump
    assert [c.step for c in rec.checkpoints] == list(range(1, err.value.step))
    assert [m.step for m in rec.steps] == list(range(1, err.value.step + 1))
    assert rec.steps[-1].train_loss > 3 * rec.steps[0].train_loss
    assert not (tmp_path / "out" / "adapter").exists()


def test_overfitting_and_memorizing_warn_once_with_their_step(pretrained_store: Path, tmp_path: Path) -> None:
    plant = tmp_path / "plant.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"what is the {a}?"},
                      {"role": "assistant", "content": f"the {a} is a plant."}]}
        for a in ANIMALS * 4
    ]  # fmt: skip
    plant.write_text("".join(json.dumps(r) + "\n" for r in rows))
    known = write_animal_chats(tmp_path / "animals.jsonl", 8)
    rec = Recorder()
    config = tiny_config(
        tmp_path, model="tiny-pretrained", model_store=pretrained_store, train_file=plant,
        validation_file=known, eval_every=2, max_steps=24, learning_rate=5e-3,
    )  # fmt: skip
    train(config, rec)
    events = health_events(rec)
    kinds = [str(d["health"]) for _, d in events]
    assert sorted(kinds) == ["memorizing", "overfitting"], events
    for message, data in events:
        step = data["step"]
        assert isinstance(step, int) and 1 <= step <= 24
        if data["health"] == "overfitting":
            assert message.startswith("Overfitting: validation loss rose")
            valid = [m.valid_loss for m in rec.steps if m.valid_loss is not None and m.step <= step]
            assert valid[-1] > valid[-2] > valid[-3]
        else:
            assert message.startswith("Memorizing: train loss")
            assert sum(m.train_loss for m in rec.steps[step - 5 : step]) / 5 < 0.05


def test_flat_loss_says_nothing_trained(tmp_path: Path) -> None:
    rec = Recorder()
    train(tiny_config(tmp_path, max_steps=12, learning_rate=1e-9), rec)
    events = health_events(rec)
    assert [d["health"] for _, d in events] == ["not_training"]
    assert events[0][1]["step"] == 12 and "raise the learning rate" in events[0][0]


# --------------------------------------------------------------------------- the default holdout


def test_holdout_of_five_percent_only_from_100_examples(tmp_path: Path) -> None:
    (tmp_path / "big").mkdir()
    (tmp_path / "small").mkdir()
    write_animal_chats(tmp_path / "big" / "train.jsonl", 120)
    rec = Recorder()
    result = train(tiny_config(tmp_path / "big", validation_split=0.05, max_steps=3), rec)
    assert any("Validation: 6 examples held out" in msg for _, msg in rec.events)
    assert any("114 examples" in msg for _, msg in rec.events)  # trained on the rest
    assert rec.steps[-1].valid_loss is not None and result.final_valid_loss is not None

    write_animal_chats(tmp_path / "small" / "train.jsonl", 60)
    rec = Recorder()
    train(tiny_config(tmp_path / "small", validation_split=0.05, max_steps=2), rec)
    assert any("No validation holdout: 60 examples are fewer than 100" in msg for _, msg in rec.events)
    assert all(m.valid_loss is None for m in rec.steps)

    rec = Recorder()
    train(tiny_config(tmp_path / "big", validation_split=0.0, max_steps=2, output_dir=tmp_path / "o"), rec)
    assert all(m.valid_loss is None for m in rec.steps)
    assert any("120 examples" in msg for _, msg in rec.events)
