"""Training health: tell the user when a run went wrong, from its losses alone.

Pure Python (no torch). The recipe feeds every step's train loss and every validation loss in;
`HealthMonitor` answers with findings (each kind reported once per run) or raises:

- diverged (fatal, `DivergedError`): a NaN/inf train loss, or once warm-up is over a train loss
  above DIVERGE_FACTOR × the first step's loss (and at least DIVERGE_MIN_RISE nats above it, so a
  run that starts near zero is not failed for the noise of one batch);
- overfitting: the validation loss rose at OVERFIT_RISES evaluations in a row while the train loss
  (its mean since the evaluation before) fell;
- memorizing: the mean train loss of the last MEMORIZE_WINDOW steps is below MEMORIZE_BELOW;
- not_training: over at least FLAT_MIN_STEPS steps, the mean loss of the last fifth of the steps is
  not FLAT_MIN_DROP (relatively) below that of the first fifth: nothing was learnt.

The thresholds depend on what the loss is (`LossRules`, one per training method). Supervised: the
cross-entropy of the answers' tokens, in nats a token, starting wherever the base model is. DPO:
the sigmoid preference loss of a pair, L = -log σ(z) with z = β((log π - log π_ref)(chosen) -
(log π - log π_ref)(rejected)) the implicit reward margin; every run starts at L = ln 2 (z = 0: the
adapter starts at B = 0, so the policy is the reference), L < ln 2 exactly when the chosen answer
is preferred, and L falls to 0 only as the margin grows without bound. So for DPO:
- diverged: measured from ln 2, not from the first step (a loss over 3 ln 2 ≈ 2.08 is a mean
  margin near -2: the policy prefers the rejected answers about 7 to 1);
- memorizing: a cross-entropy of 0.05 (each answer token at p ≈ 0.95) is reciting, but a DPO loss
  of 0.05 is a margin of only 3, common in a healthy run; DPO warns when the mean loss is below
  log(1 + e^-DPO_MEMORIZE_MARGIN) ≈ 0.0067, i.e. the training pairs sit at a margin of 5 or more
  (5/β nats of log-ratio gap: 50 at β = 0.1): the policy has moved far from the reference to
  separate these very pairs, which fits them rather than the preference;
- not_training: the last fifth's mean loss is compared with ln 2, where every DPO run starts.

With the chosen answers' NLL in the loss (rpo_alpha α > 0: L = DPO + α · NLL, the NLL a mean over
the chosen answers' tokens), a run starts at ln 2 + α · NLL₀, NLL₀ the base's NLL of the training
set's chosen answers, which the reference pass gives for free (`dpo_rules`; one batch's start
differs from it by α times that batch's deviation, as a supervised run's first batch does). Each
rule above is measured from there; memorizing is below DPO's bar + α × the supervised bar (0.05):
the loss can only fall below it when the DPO term is under its bar or the NLL under 0.05.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, Literal

from worker.engine.training_config import MethodType
from worker.engine.types import DivergedError, NonFiniteError

HealthKind = Literal["overfitting", "memorizing", "not_training"]

DIVERGE_FACTOR = 3.0
DIVERGE_MIN_RISE = 1.0
OVERFIT_RISES = 2
MEMORIZE_BELOW = 0.05
MEMORIZE_WINDOW = 5
FLAT_MIN_STEPS = 10
FLAT_MIN_DROP = 0.01
LN2 = math.log(2)  # DPO's loss at z = 0, where every DPO run starts
DPO_MEMORIZE_MARGIN = 5.0
DPO_MEMORIZE_BELOW = math.log1p(math.exp(-DPO_MEMORIZE_MARGIN))  # -log σ(5) ≈ 0.0067


@dataclass(frozen=True)
class LossRules:
    """What a method's loss says about a run (the module docstring gives each rule and why)."""

    name: str  # the loss, as the messages call it
    start: float | None  # where every run's loss starts (None: at its own first step's)
    memorize_below: float
    memorizing_hint: str
    flat_hint: str


RULES: dict[MethodType, LossRules] = {
    "supervised": LossRules(
        "train loss",
        None,
        MEMORIZE_BELOW,
        "the model recites its training data; use fewer epochs or more data, and watch the validation loss",
        "raise the learning rate, or check that the examples have assistant turns to learn",
    ),
    "dpo": LossRules(
        "DPO loss",
        LN2,
        DPO_MEMORIZE_BELOW,
        f"the training pairs are separated by an implicit reward margin over {DPO_MEMORIZE_MARGIN:g}: the "
        "adapter fits these pairs far from the base; use fewer epochs, a larger beta or more pairs, "
        "and watch the validation loss",
        f"it stayed near ln 2 = {LN2:.4f}, where the policy equals the reference; raise the learning "
        "rate, or check that the preferred and non-preferred answers differ",
    ),
}


def dpo_rules(rpo_alpha: float, chosen_nll: float) -> LossRules:
    """DPO's rules for a loss of DPO + `rpo_alpha` × the chosen answers' NLL per token, the base's
    NLL of the training set's chosen answers being `chosen_nll` (the module docstring says why)."""
    dpo = RULES["dpo"]
    if rpo_alpha == 0:
        return dpo
    start = LN2 + rpo_alpha * chosen_nll
    return LossRules(
        "DPO + NLL loss",
        start,
        DPO_MEMORIZE_BELOW + rpo_alpha * MEMORIZE_BELOW,
        f"either the training pairs are separated by a margin over {DPO_MEMORIZE_MARGIN:g} or the "
        f"chosen answers' NLL is below {MEMORIZE_BELOW:g} a token: the adapter fits these very pairs; use "
        "fewer epochs, a larger beta or more pairs, and watch the validation loss",
        f"it stayed near its start ln 2 + rpo_alpha x the base's NLL of the chosen answers = {start:.4f}; "
        "raise the learning rate, or check that the preferred and non-preferred answers differ",
    )


@dataclass(frozen=True)
class Finding:
    kind: HealthKind
    step: int
    message: str

    def data(self) -> dict[str, Any]:
        """The event's data: what the dashboard needs to put a badge on the job and the chart."""
        return {"health": self.kind, "step": self.step}


@dataclass
class HealthMonitor:
    warmup_steps: int = 0
    method: MethodType = "supervised"
    rules: LossRules | None = None  # the method's RULES unless set (a DPO run's `dpo_rules`)
    first_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    # (step, validation loss, mean train loss since the evaluation before)
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    reported: set[HealthKind] = field(default_factory=set)
    _since_eval: list[float] = field(default_factory=list)

    @property
    def loss_rules(self) -> LossRules:
        return self.rules if self.rules is not None else RULES[self.method]

    def _once(self, kind: HealthKind, step: int, message: str) -> list[Finding]:
        if kind in self.reported:
            return []
        self.reported.add(kind)
        return [Finding(kind, step, message)]

    def check_step(self, step: int, loss: float) -> list[Finding]:
        """Before the optimizer applies this step: raise if it diverged, else the new findings."""
        if not math.isfinite(loss):
            raise NonFiniteError(step, "loss")
        rules = self.loss_rules
        if self.first_loss is None:
            self.first_loss = loss
        elif step > self.warmup_steps:
            start = self.first_loss if rules.start is None else rules.start
            if loss > max(DIVERGE_FACTOR * start, start + DIVERGE_MIN_RISE):
                value = "its first value" if rules.start is None else "where every run starts,"
                raise DivergedError(
                    step, f"{rules.name} {loss:.4g} is over {DIVERGE_FACTOR:g}x {value} {start:.4g}"
                )
        self.losses.append(loss)
        self._since_eval.append(loss)
        recent = self.losses[-MEMORIZE_WINDOW:]
        if len(recent) == MEMORIZE_WINDOW and fmean(recent) < rules.memorize_below:
            return self._once(
                "memorizing",
                step,
                f"Memorizing: {rules.name} {fmean(recent):.4f} < {rules.memorize_below:.2g} at step {step}: "
                f"{rules.memorizing_hint}",
            )
        return []

    def check_eval(self, step: int, valid_loss: float) -> list[Finding]:
        since = self._since_eval or self.losses[-1:]
        train = fmean(since) if since else math.nan
        self._since_eval = []
        self.evals.append((step, valid_loss, train))
        if len(self.evals) <= OVERFIT_RISES:
            return []
        window = self.evals[-(OVERFIT_RISES + 1) :]
        valid_rising = all(b[1] > a[1] for a, b in itertools.pairwise(window))
        train_falling = window[-1][2] < window[0][2]
        if not (valid_rising and train_falling):
            return []
        return self._once(
            "overfitting",
            step,
            f"Overfitting: validation loss rose {window[0][1]:.4f} -> {valid_loss:.4f} over the last "
            f"{OVERFIT_RISES} evaluations while train loss fell {window[0][2]:.4f} -> {window[-1][2]:.4f}; "
            "use an earlier checkpoint, fewer epochs or more data",
        )

    def check_progress(self, step: int) -> list[Finding]:
        """Has the train loss moved at all? Called mid-run and at the end."""
        if len(self.losses) < FLAT_MIN_STEPS:
            return []
        rules = self.loss_rules
        n = max(1, len(self.losses) // 5)
        head = fmean(self.losses[:n]) if rules.start is None else rules.start
        tail = fmean(self.losses[-n:])
        if head - tail >= FLAT_MIN_DROP * abs(head):
            return []
        return self._once(
            "not_training",
            step,
            f"Nothing trained: {rules.name} flat over {len(self.losses)} steps ({head:.4f} -> {tail:.4f}); "
            f"{rules.flat_hint}",
        )
