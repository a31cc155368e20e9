"""The validation holdout: how many examples a job sets apart from its training file, and the one
sentence that says so.

Pure Python (no torch): the engine (its "Validation"/"No validation holdout" event), the dry run
and the dashboard's job summary all say what the holdout is with `holdout_sentence`, so no page can
promise a holdout the run does not make.
"""

from __future__ import annotations

HOLDOUT_MIN_EXAMPLES = 100  # fewer examples: every one is needed for training, none held out
HOLDOUT_MAX_EXAMPLES = 200  # enough for a steady validation loss; more only slows evaluation


def holdout_size(examples: int, fraction: float) -> int:
    """How many examples a `fraction` holdout takes from a file of `examples` examples."""
    if fraction <= 0 or examples < HOLDOUT_MIN_EXAMPLES:
        return 0
    return min(HOLDOUT_MAX_EXAMPLES, max(1, round(fraction * examples)))


def _percent(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def holdout_sentence(*, examples: int | None, fraction: float, validation_file: str | None) -> str:
    """What the run validates on, in words. `examples`: the training file's valid examples, or
    None where they have not been counted (the sentence then states the rule)."""
    if validation_file is not None:
        return f"Validation on the validation file {validation_file}; nothing held out of the training file"
    if fraction <= 0:
        return "No validation holdout: validation_split is 0, every example is trained on"
    if examples is None:
        return (
            f"{_percent(fraction)} of the examples held out for validation (at most "
            f"{HOLDOUT_MAX_EXAMPLES}) if the training file has {HOLDOUT_MIN_EXAMPLES} examples or "
            "more; none with fewer"
        )
    held = holdout_size(examples, fraction)
    if held == 0:
        return (
            f"No validation holdout: {examples} examples are fewer than {HOLDOUT_MIN_EXAMPLES}; "
            "give a validation_file for a validation curve"
        )
    return (
        f"Validation: {held} examples held out of the training file's {examples} "
        f"({_percent(fraction)}, at most {HOLDOUT_MAX_EXAMPLES}); validation_split 0 trains on all of them"
    )
