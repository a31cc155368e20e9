"""Every training choice of a fine-tune, declared once: its default, its range and what it means.

The models below are the one source of each field; the others are views built from them:

- `TrainingConfig` = `Hyperparameters` + `TrainingOptions`: the whole training configuration, flat.
  A `loraq train` YAML file is a `TrainingConfig` plus where the run reads and writes
  (worker/engine/config_file.py); the claim a worker takes holds one; the engine's `TrainConfig`
  is built from one (`worker.engine.types.TrainConfig.build`).
- The API's `JobCreate` (service/schemas.py) is `TrainingOptions` + `Placement` at the top level
  of the body and `Hyperparameters` under `hyperparameters` (or `method.supervised.hyperparameters`),
  as OpenAI lays a job out. The job row stores the same fields (service/jobs.py).

OpenAI's three hyperparameters may be "auto"; `resolve_auto` is the one place that turns them into
numbers (a job when it is claimed, a dry run's plan, `loraq train`), and `plan_steps` the one place
that turns rows into optimizer steps. Pure pydantic and the standard
library: the API process imports this module and must not load torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
)

BASE_LEARNING_RATE = 2e-4  # the AdamW peak learning rate that learning_rate_multiplier scales
# What "auto" resolves to (OpenAI also resolves its "auto" when the job starts).
AUTO_N_EPOCHS = 3
AUTO_BATCH_SIZE = 4
AUTO_LEARNING_RATE_MULTIPLIER = 1.0
# A local run (`loraq train` YAML, a TrainConfig built in code) without n_epochs makes one pass.
LOCAL_N_EPOCHS = 1

MAX_N_EPOCHS = 1000
MAX_BATCH_SIZE = 1024
MAX_LR_MULTIPLIER = 100.0
MAX_SEQ_LEN = 32768
MAX_SEED = 2**31 - 1
MAX_EVAL_PROMPTS = 16
MAX_EVAL_PROMPT_CHARS = 2000

Auto = Literal["auto"]
SchedulerName = Literal["cosine", "linear", "constant"]


def _auto_or_int(lo: int, hi: int) -> Callable[[object], int | Auto]:
    # One validator per "auto"-or-number field, so an error names the field rather than a union branch.
    def check(v: object) -> int | Auto:
        if v == "auto" and isinstance(v, str):
            return "auto"
        if isinstance(v, bool) or not isinstance(v, int | float) or int(v) != v:
            raise ValueError(f'must be an integer or "auto", got {v!r}')
        if not lo <= int(v) <= hi:
            raise ValueError(f"must be between {lo} and {hi}, got {v!r}")
        return int(v)

    return check


def _auto_or_positive(hi: float) -> Callable[[object], float | Auto]:
    def check(v: object) -> float | Auto:
        if v == "auto" and isinstance(v, str):
            return "auto"
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f'must be a number or "auto", got {v!r}')
        if not 0 < float(v) <= hi:
            raise ValueError(f"must be > 0 and <= {hi}, got {v!r}")
        return float(v)

    return check


def _auto_schema(kind: str, **bounds: float) -> WithJsonSchema:
    return WithJsonSchema({"anyOf": [{"type": kind, **bounds}, {"const": "auto"}]})


def encodable(v: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); no database column can store them."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from e
    return v


Text = Annotated[str, AfterValidator(encodable)]
NEpochs = Annotated[
    int | Auto,
    PlainValidator(_auto_or_int(1, MAX_N_EPOCHS)),
    _auto_schema("integer", minimum=1, maximum=MAX_N_EPOCHS),
]
BatchSize = Annotated[
    int | Auto,
    PlainValidator(_auto_or_int(1, MAX_BATCH_SIZE)),
    _auto_schema("integer", minimum=1, maximum=MAX_BATCH_SIZE),
]
LrMultiplier = Annotated[
    float | Auto,
    PlainValidator(_auto_or_positive(MAX_LR_MULTIPLIER)),
    _auto_schema("number", exclusiveMinimum=0, maximum=MAX_LR_MULTIPLIER),
]
ModuleName = Annotated[str, Field(min_length=1, max_length=128)]


def _targets_shape(v: object) -> object:
    # Checked before the union, so a wrong shape is one error naming the field, not one per branch.
    if v != "all-linear" and not (isinstance(v, list) and v and all(isinstance(t, str) for t in v)):
        raise ValueError(f"must be 'all-linear' or a non-empty list of module names, got {v!r}")
    return v


TargetModules = Annotated[
    Annotated[list[ModuleName], Field(min_length=1)] | Literal["all-linear"], BeforeValidator(_targets_shape)
]
EvalPrompt = Annotated[Text, Field(min_length=1, max_length=MAX_EVAL_PROMPT_CHARS)]


class Strict(BaseModel):
    """Unknown fields and NaN/inf are errors that name the field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LoraConfig(Strict):
    """The LoRA adapter's shape."""

    r: int = Field(16, ge=1, le=1024, description="rank of the adapter's two matrices")
    alpha: float = Field(32.0, gt=0, le=4096, description="scale = alpha / r (alpha / √r with use_rslora)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: TargetModules = Field(
        "all-linear",
        description="leaf names (q_proj) or path suffixes (mlp.down_proj); all-linear: every linear "
        "layer except lm_head",
        examples=[["q_proj", "v_proj"]],
    )
    use_rslora: bool = Field(False, description="rank-stabilised scale alpha / √r")


class Hyperparameters(Strict):
    """OpenAI's hyperparameters: each a number, or "auto" (resolved by `resolve_auto`)."""

    n_epochs: NEpochs = Field("auto", description=f"passes over the training file; auto: {AUTO_N_EPOCHS}")
    batch_size: BatchSize = Field(
        "auto", description=f"training rows per micro-batch; auto: {AUTO_BATCH_SIZE}"
    )
    learning_rate_multiplier: LrMultiplier = Field(
        "auto",
        description=f"the AdamW peak learning rate is this × {BASE_LEARNING_RATE}; "
        f"auto: {AUTO_LEARNING_RATE_MULTIPLIER}",
    )


class TrainingOptions(Strict):
    """Loraq's training fields beside OpenAI's hyperparameters (the top level of a job request)."""

    lora: LoraConfig = Field(default_factory=LoraConfig, description="the LoRA adapter's shape")
    max_seq_len: int = Field(
        1024, ge=16, le=MAX_SEQ_LEN, description="tokens per training row; longer examples are errors"
    )
    packing: bool = Field(
        True,
        description="pack examples into rows of max_seq_len tokens, each attending only to itself "
        "(padding-free); false: one example per row, padded",
    )
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="LoRA init and data order; unset: random for a job, 0 locally"
    )
    validation_split: float | None = Field(
        None,
        ge=0,
        le=0.5,
        description="without a validation file, the share of examples held out for the validation loss "
        "(at most 200, only from 100 examples on); unset: LORAQ_VALIDATION_SPLIT for a job, 0 locally",
    )
    lr_scheduler: SchedulerName = Field("cosine", description="decay after warmup (to 0 for cosine/linear)")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="fraction of the steps of linear warmup")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay on the adapter")
    grad_accum: int = Field(1, ge=1, le=4096, description="micro-batches per optimizer step")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="global gradient-norm clipping")
    eval_every: int = Field(
        0, ge=0, description="steps between validation losses (0: only at epoch ends and the end)"
    )
    checkpoint_every: int | None = Field(
        None,
        ge=0,
        description="steps between checkpoints; unset: LORAQ_CHECKPOINT_EVERY for a job, "
        "only at the end locally",
    )
    eval_prompts: list[EvalPrompt] | None = Field(
        None,
        max_length=MAX_EVAL_PROMPTS,
        description="answered greedily at every checkpoint, shown per checkpoint on the dashboard",
    )

    def options(self) -> dict[str, Any]:
        """This object's `TrainingOptions` fields, as typed values (a subclass has more fields)."""
        return {name: getattr(self, name) for name in TrainingOptions.model_fields}


class Placement(Strict):
    """Where a job runs (a job's fields only: `loraq train` runs here)."""

    queue: str | None = Field(
        None,
        min_length=1,
        max_length=40,
        pattern=r"^[A-Za-z0-9_-]+$",
        description='the worker class to run on (its queue, e.g. "h100", "cpu"); unset: LORAQ_WORKER_QUEUE',
    )
    n_gpus: int = Field(1, ge=1, le=8, description="GPUs on one host; > 1 runs data-parallel under torchrun")


class TrainingConfig(Hyperparameters, TrainingOptions):
    """Every training field, flat."""

    def hyperparameter_block(self) -> Hyperparameters:
        """OpenAI's part, as a job shows it under `hyperparameters`."""
        return Hyperparameters(**{name: getattr(self, name) for name in Hyperparameters.model_fields})


def resolve_auto(config: TrainingConfig) -> TrainingConfig:
    """The config with every "auto" replaced by the number it means."""
    return config.model_copy(
        update={
            "n_epochs": AUTO_N_EPOCHS if config.n_epochs == "auto" else config.n_epochs,
            "batch_size": AUTO_BATCH_SIZE if config.batch_size == "auto" else config.batch_size,
            "learning_rate_multiplier": AUTO_LEARNING_RATE_MULTIPLIER
            if config.learning_rate_multiplier == "auto"
            else config.learning_rate_multiplier,
        }
    )


@dataclass(frozen=True)
class StepPlan:
    """How a run of `rows` training rows is cut into steps."""

    micro_batches_per_epoch: int  # batches of batch_size rows per pass (the last may be short)
    micro_batches: int  # of the whole run
    steps: int  # optimizer steps of grad_accum micro-batches (the run's last may have fewer)


def batches_per_epoch(rows: int, batch_size: int) -> int:
    """Micro-batches in one pass over `rows` rows: the last batch takes what is left."""
    return -(-rows // batch_size)


def plan_steps(
    rows: int, *, batch_size: int, n_epochs: int, grad_accum: int, max_steps: int | None = None
) -> StepPlan:
    """The engine's step count (worker/engine/recipe.py) and a dry run's (service/dry_run.py) both
    come from here, so a plan cannot drift from the run. `max_steps` (a local run's) overrides
    n_epochs."""
    per_epoch = batches_per_epoch(rows, batch_size)
    if max_steps is not None:
        return StepPlan(per_epoch, max_steps * grad_accum, max_steps)
    micro = n_epochs * per_epoch
    return StepPlan(per_epoch, micro, -(-micro // grad_accum))


def learning_rate(config: TrainingConfig) -> float:
    """The AdamW peak learning rate of a config ("auto" resolved)."""
    return BASE_LEARNING_RATE * float(resolve_auto(config).learning_rate_multiplier)
