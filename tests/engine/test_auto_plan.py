"""`plan_auto`: "auto" hyperparameters planned in optimizer steps from the tokenized data.

The rule (worker/engine/training_config.py's docstring, the README's "Engine configuration"): a
small file still gets at least AUTO_MIN_STEPS optimizer steps (packed into shorter rows, one a
step), a large one keeps 4 full rows a step; epochs follow OpenAI's seen-100-to-25,000 rule.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import WriteJsonl, chat
from worker.engine.data import planned_datasets, read_valid_examples
from worker.engine.models import LoadedModel
from worker.engine.training_config import (
    AUTO_BATCH_SIZE,
    AUTO_MIN_STEPS,
    AUTO_ROW_MULTIPLE,
    BASE_LEARNING_RATE,
    DataShape,
    TrainingConfig,
    plan_job,
    plan_sentence,
    plan_steps,
)
from worker.engine.types import TrainConfig

PIRATE = Path(__file__).resolve().parents[1] / "data" / "pirate" / "train.jsonl"


def test_epochs_follow_the_seen_100_to_25000_rule() -> None:
    def epochs(n: int) -> int:
        return plan_job(TrainingConfig(), DataShape(examples=n, tokens=n * 50, longest=50)).n_epochs

    assert epochs(64) == 3  # 192 example-passes: in the range
    assert epochs(20) == 5 and epochs(3) == 25 and epochs(1) == 25  # raised to 100+, at most 25
    assert epochs(10_000) == 2 and epochs(30_000) == 1  # lowered to at most 25,000, at least 1


def test_a_large_file_keeps_four_full_rows_a_step() -> None:
    plan = plan_job(
        TrainingConfig(max_seq_len=1024), DataShape(examples=3000, tokens=1_800_000, longest=1000)
    )
    assert (plan.batch_size, plan.row_tokens, plan.n_epochs) == (AUTO_BATCH_SIZE, 1024, 3)
    assert "4 row(s) of 1024 tokens a step" in plan.reason


def test_a_mid_file_takes_fewer_full_rows_for_enough_steps() -> None:
    plan = plan_job(TrainingConfig(max_seq_len=1024), DataShape(examples=200, tokens=60_000, longest=500))
    assert plan.row_tokens == 1024 and plan.batch_size == 3  # 180k tokens / 48 steps = 3,750 a step
    rows = -(-60_000 // 1024)  # at least this many full rows
    assert plan_steps(rows, batch_size=3, n_epochs=3, grad_accum=1).steps >= AUTO_MIN_STEPS


def test_a_small_file_is_packed_into_shorter_rows_of_one_a_step() -> None:
    plan = plan_job(TrainingConfig(max_seq_len=1024), DataShape(examples=64, tokens=3626, longest=61))
    assert plan.batch_size == 1
    assert plan.row_tokens % AUTO_ROW_MULTIPLE == 0 and 61 <= plan.row_tokens <= 3 * 3626 // AUTO_MIN_STEPS
    assert "packed rows of up to" in plan.reason and "at least 48 steps" in plan.reason


def test_the_longest_example_bounds_the_row_from_below() -> None:
    plan = plan_job(TrainingConfig(max_seq_len=512), DataShape(examples=40, tokens=4000, longest=300))
    assert plan.row_tokens == 320  # 300 rounded up to a multiple of 64; the aim (250) is shorter


def test_given_numbers_are_kept_and_rows_stay_full() -> None:
    shape = DataShape(examples=64, tokens=3626, longest=61)
    plan = plan_job(
        TrainingConfig(n_epochs=2, batch_size=8, learning_rate_multiplier=5.0, max_seq_len=1024), shape
    )
    assert (plan.n_epochs, plan.batch_size, plan.learning_rate_multiplier, plan.row_tokens) == (
        2,
        8,
        5.0,
        1024,
    )
    assert plan.reason == "every hyperparameter set by the request"
    # an explicit epoch count still feeds the batch rule
    two = plan_job(TrainingConfig(n_epochs=1, max_seq_len=1024), shape)
    assert two.n_epochs == 1 and two.row_tokens < plan_job(TrainingConfig(max_seq_len=1024), shape).row_tokens


def test_unpacked_takes_one_to_four_examples_a_step() -> None:
    def batch(n: int) -> int:
        config = TrainingConfig(packing=False)
        return plan_job(config, DataShape(examples=n, tokens=n * 60, longest=60)).batch_size

    assert batch(64) == 4  # 3 · 64 / 48 = 4 examples a step: 48 steps
    assert batch(40) == 2 and batch(10_000) == AUTO_BATCH_SIZE


def test_grad_accum_and_gpus_are_counted() -> None:
    shape = DataShape(examples=64, tokens=3626, longest=61)
    one = plan_job(TrainingConfig(), shape)
    accum = plan_job(TrainingConfig(grad_accum=2), shape)
    assert accum.row_tokens < one.row_tokens  # a step is two micro-batches: each carries half
    two_gpus = plan_job(TrainingConfig(), shape, world_size=2)
    assert two_gpus.batch_size == 2  # every rank takes a row of each step


def test_per_gpu_batch_scaling_keeps_each_ranks_rows_and_scales_the_rate() -> None:
    """batch_scaling per_gpu: batch_size is each rank's rows (auto picks per-rank rows), the global
    batch is world× that, and the learning rate √world×; the plan sentence (the job's first event,
    the dry run's `plan`) says so and why. On one GPU it is the global mode."""
    small = DataShape(examples=64, tokens=3626, longest=61)
    large = DataShape(examples=10_000, tokens=4_000_000, longest=900)
    given = TrainingConfig(batch_size=2, learning_rate_multiplier=1.0, batch_scaling="per_gpu")
    plan = plan_job(given, small, world_size=2)
    assert (plan.batch_size, plan.global_batch) == (2, 4)
    assert plan.learning_rate == pytest.approx(BASE_LEARNING_RATE * 2**0.5)
    assert plan.hyperparameters()["batch_size"] == 2  # the job shows the per-GPU rows it was given
    sentence = plan_sentence(small, rows=64, steps=16, plan=plan)
    assert "2 row(s) per GPU x 2 GPUs = 4 row(s)" in sentence
    assert "peak learning rate 2.8e-04" in sentence
    assert "batch_scaling per_gpu" in sentence and "square-root rule for Adam" in sentence
    assert "Malladi et al. 2022" in sentence
    # global mode on 2 GPUs: the same 2 rows split, the rate as given, and the sentence says so
    split = plan_job(TrainingConfig(batch_size=2), small, world_size=2)
    assert (split.global_batch, split.learning_rate) == (2, BASE_LEARNING_RATE)
    assert "batch_scaling global: the 2 row(s) split over 2 GPUs" in split.reason
    # under 4 rows a GPU: the plan says the step waits for the slowest GPU, and what scales further
    assert "up to 1 row(s) a GPU: each step lasts as long as its slowest GPU's rows" in split.reason
    assert "3.3x at 1 row a GPU, 3.55x at 2, 3.7x at 4" in split.reason
    assert "batch_size 8 or more, or batch_scaling per_gpu" in split.reason
    two_each = plan_job(TrainingConfig(batch_size=4), small, world_size=2)
    assert "up to 2 row(s) a GPU" in two_each.reason
    four_each = plan_job(TrainingConfig(batch_size=8), small, world_size=2)
    assert "split over 2 GPUs" in four_each.reason and "slowest GPU" not in four_each.reason
    # on one GPU per_gpu is global: same batch, same rate
    one = plan_job(given, small)
    assert (one.global_batch, one.learning_rate) == (2, BASE_LEARNING_RATE)
    # auto: a large file keeps AUTO_BATCH_SIZE full rows on each rank (global mode: over all ranks)
    auto = TrainingConfig(batch_scaling="per_gpu")
    assert plan_job(auto, large, world_size=4).global_batch == 4 * AUTO_BATCH_SIZE
    assert plan_job(TrainingConfig(), large, world_size=4).global_batch == AUTO_BATCH_SIZE
    # a small file: one shorter row per rank, each about 1/world of one GPU's, so the run still
    # makes at least AUTO_MIN_STEPS steps of world rows
    alone, four = plan_job(auto, small), plan_job(auto, small, world_size=4)
    assert (four.batch_size, four.global_batch) == (1, 4)
    assert four.row_tokens < alone.row_tokens


@pytest.mark.parametrize("packing", [True, False])
def test_the_readme_quickstart_plans_enough_steps(tiny: LoadedModel, packing: bool) -> None:
    """The README's first fine-tune (the pirate set, every hyperparameter auto) in real rows: at
    least AUTO_MIN_STEPS optimizer steps (it was 3 with packing before this rule), each row within
    the planned length, and the engine's TrainConfig planning exactly as the job path plans."""
    examples, fmt = read_valid_examples(PIRATE, tiny.tokenizer, 1024)
    training = TrainingConfig(packing=packing)
    planned = planned_datasets(
        examples,
        tiny.tokenizer,
        1024,
        fmt,
        pack=packing,
        holdout=0.05,
        seed=0,
        planner=lambda shape: plan_job(training, shape),
    )
    plan = planned.plan
    steps = plan_steps(
        len(planned.train.rows), batch_size=plan.batch_size, n_epochs=plan.n_epochs, grad_accum=1
    )
    assert AUTO_MIN_STEPS <= steps.steps <= 2 * AUTO_MIN_STEPS
    assert planned.held_out is None  # 64 examples: too few to hold any out
    assert all(len(r.input_ids) <= plan.row_tokens for r in planned.train.rows)
    engine = TrainConfig.build(
        training, model="tiny-llama", train_file=PIRATE, output_dir=Path("."), model_store=Path(".")
    )
    assert engine.auto == ("n_epochs", "batch_size", "learning_rate")
    assert engine.plan(planned.shape) == plan
    done = engine.planned(plan)
    assert (done.n_epochs, done.batch_size, done.auto) == (plan.n_epochs, plan.batch_size, ())
    assert done.row_tokens == (plan.row_tokens if plan.row_tokens != 1024 else None)


def test_a_planned_run_keeps_its_rows_when_planned_again(write_jsonl: WriteJsonl) -> None:
    """A config planned once (a resumed or multi-GPU rank's) plans to the same rows again."""
    shape = DataShape(examples=64, tokens=3626, longest=61)
    first = TrainConfig.build(
        TrainingConfig(),
        model="m",
        train_file=write_jsonl([chat(("user", "a"), ("assistant", "b"))]),
        output_dir=Path("."),
        model_store=Path("."),
    )
    done = first.planned(first.plan(shape))
    again = done.plan(shape)
    assert again.row_tokens == done.row_tokens and again.batch_size == done.batch_size
