"""The validation holdout's rule and its one sentence (worker/engine/holdout.py), which the engine's
event, the dry run and the dashboard's job page all use."""

from __future__ import annotations

from worker.engine.holdout import HOLDOUT_MAX_EXAMPLES, holdout_sentence, holdout_size


def test_holdout_takes_a_share_only_from_100_examples_on_and_at_most_200() -> None:
    assert holdout_size(99, 0.05) == 0
    assert holdout_size(100, 0.05) == 5
    assert holdout_size(120, 0.05) == 6
    assert holdout_size(100_000, 0.05) == HOLDOUT_MAX_EXAMPLES
    assert holdout_size(10_000, 0.0) == 0


def test_the_sentence_says_what_the_rule_does() -> None:
    def say(examples: int | None, fraction: float = 0.05, validation_file: str | None = None) -> str:
        return holdout_sentence(examples=examples, fraction=fraction, validation_file=validation_file)

    assert say(64) == (
        "No validation holdout: 64 examples are fewer than 100; give a validation_file for a validation curve"
    )
    assert say(120) == (
        "Validation: 6 examples held out of the training file's 120 (5%, at most 200); "
        "validation_split 0 trains on all of them"
    )
    assert say(120, 0.025).startswith("Validation: 3 examples held out of the training file's 120 (2.5%,")
    # not counted yet: the rule, never a promise of a holdout
    assert say(None) == (
        "5% of the examples held out for validation (at most 200) if the training file has 100 "
        "examples or more; none with fewer"
    )
    assert say(500, 0.0) == "No validation holdout: validation_split is 0, every example is trained on"
    assert say(500, 0.0, "file-abc") == (
        "Validation on the validation file file-abc; nothing held out of the training file"
    )
