"""Every training choice of a fine-tune, declared once: its default, its range and what it means.

The models below are the one source of each field; the others are views built from them:

- `TrainingConfig` = `Hyperparameters` + `TrainingOptions`: the whole training configuration, flat.
  A `loraq train` YAML file is a `TrainingConfig` plus where the run reads and writes
  (worker/engine/config_file.py); the claim a worker takes holds one; the engine's `TrainConfig`
  is built from one (`worker.engine.types.TrainConfig.build`).
- The API's `JobCreate` (service/schemas.py) is `TrainingOptions` + `Placement` at the top level
  of the body and `Hyperparameters` under `hyperparameters` (or `method.supervised.hyperparameters`),
  as OpenAI lays a job out. The job row stores the same fields (service/jobs.py).

OpenAI's three hyperparameters may be "auto"; `plan_auto` is the one place that turns them into
numbers, from the tokenized training data (a job and its dry run, both once the examples are
tokenized; `loraq train`), and `plan_steps` the one place that turns rows into optimizer steps.
Pure pydantic and the standard library: the API process imports this module and must not load torch.

How "auto" plans a run (`plan_auto`; the README's "Engine configuration" states the same rule):

- n_epochs: 3, OpenAI's rule for small and large files: a file of N examples is seen at least
  100 times in all (ceil(100 / N) epochs, at most 25) and at most 25,000 times (25,000 // N, at
  least 1).
- batch (the tokens of one optimizer step): at most 4 rows of max_seq_len tokens (the step the
  fast path is measured at), and fewer so that the run makes at least 48 optimizer steps. With
  packing on, a row holds several examples, so a small file used to be a handful of steps (64
  short chats: 4 rows, 3 steps in all) and the model did not visibly change; auto now packs such a
  file into shorter rows (n_epochs · tokens / 48 rounded down to a multiple of 64, but at least
  its longest example) and steps of one row each. Without packing the same aim
  picks 1 to 4 examples a step. A large file keeps 4 full rows a step.
- learning_rate_multiplier: 1 (AdamW peak 2e-4, the usual LoRA rate; with the steps above it
  moves a 135M model's answers within one quickstart run).
"""

from __future__ import annotations

import math
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
# What "auto" plans from (`plan_auto`; OpenAI also resolves its "auto" when the job starts).
AUTO_N_EPOCHS = 3
AUTO_MIN_EXAMPLES_SEEN = 100  # a small file gets more epochs, up to AUTO_MAX_EPOCHS
AUTO_MAX_EXAMPLES_SEEN = 25_000  # a large file fewer, down to 1
AUTO_MAX_EPOCHS = 25
AUTO_BATCH_SIZE = 4  # rows of max_seq_len a step at most (and examples a step unpacked)
AUTO_MIN_STEPS = 48  # optimizer steps auto aims for at least, by making steps smaller
# rows a GPU below which a global-mode multi-GPU plan says its GPUs stay short of N× (measured)
MULTI_GPU_ROWS_PER_GPU = 4
AUTO_ROW_MULTIPLE = 64  # shortened packed rows are a multiple of this many tokens
AUTO_LEARNING_RATE_MULTIPLIER = 1.0
AUTO_DPO_BETA = 0.1  # DPO's beta when "auto" (the DPO paper's and TRL's default)
MAX_DPO_BETA = 10.0
# The weight of the chosen answers' NLL beside the DPO loss when "auto" (RPO, Pang et al. 2024, whose
# alpha is 1; TRL's rpo_alpha, in TRL 1.16 loss_type ["sigmoid", "sft"] with loss_weights [1, alpha]).
# Why on by default: DPO alone lowers the likelihood of both answers and, on small sets, degraded a
# 135M model's text (tests/engine/test_dpo_quality.py: held-out answers looping or garbled, 1/10 in
# the chosen style); the chosen answers' NLL anchors it (7/10, none looping).
AUTO_RPO_ALPHA = 1.0
MAX_RPO_ALPHA = 100.0
# A local run (`loraq train` YAML, a TrainConfig built in code) without n_epochs makes one pass.
LOCAL_N_EPOCHS = 1

MAX_N_EPOCHS = 1000
MAX_BATCH_SIZE = 1024
MAX_LR_MULTIPLIER = 100.0
MAX_SEQ_LEN = 32768
MAX_SEED = 2**31 - 1
MAX_STEP_INTERVAL = 2**31 - 1  # eval_every, checkpoint_every: an INTEGER column's largest value
MAX_EVAL_PROMPTS = 16
MAX_EVAL_PROMPT_CHARS = 2000
MAX_NODES = 16  # hosts of one job (n_nodes)

Auto = Literal["auto"]
SchedulerName = Literal["cosine", "linear", "constant"]
# How the frozen base is stored (worker/engine/quantize.py); None: dense in the activation dtype
QuantizationName = Literal["nf4", "int8", "gguf"]
# How batch_size meets several GPUs (`batch_scaling`): "global" splits it over the ranks (strong
# scaling), "per_gpu" gives every rank batch_size rows (weak scaling, see `lr_scale`)
BatchScaling = Literal["global", "per_gpu"]


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


def _auto_or_positive(hi: float, *, zero: bool = False) -> Callable[[object], float | Auto]:
    """A number in (0, hi] ([0, hi] with `zero`), or "auto"."""

    def check(v: object) -> float | Auto:
        if v == "auto" and isinstance(v, str):
            return "auto"
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f'must be a number or "auto", got {v!r}')
        low_ok = float(v) >= 0 if zero else float(v) > 0
        if not low_ok or float(v) > hi:
            raise ValueError(f"must be {'>=' if zero else '>'} 0 and <= {hi}, got {v!r}")
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
Beta = Annotated[
    float | Auto,
    PlainValidator(_auto_or_positive(MAX_DPO_BETA)),
    _auto_schema("number", exclusiveMinimum=0, maximum=MAX_DPO_BETA),
]
RpoAlpha = Annotated[
    float | Auto,
    PlainValidator(_auto_or_positive(MAX_RPO_ALPHA, zero=True)),
    _auto_schema("number", minimum=0, maximum=MAX_RPO_ALPHA),
]
RPO_ALPHA_DESCRIPTION = (
    "Loraq's extension (TRL's rpo_alpha; RPO, Pang et al. 2024): the weight of the chosen answers' "
    "negative log-likelihood, a mean over their tokens, added to the DPO loss; 0 is DPO alone. DPO "
    "alone lowers the likelihood of both answers and degrades the text on small sets (a 135M model's "
    "answers looped); the chosen answers' NLL anchors it. "
    f"auto: {AUTO_RPO_ALPHA}"
)
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
    quantization: QuantizationName | None = Field(
        None,
        description="the frozen base's storage (QLoRA): nf4 or int8 (quantized as it loads), gguf (a "
        "GGUF base keeps its file's blocks); unset: dense bf16. The adapter loads on the dense base",
    )
    lr_scheduler: SchedulerName = Field("cosine", description="decay after warmup (to 0 for cosine/linear)")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="fraction of the steps of linear warmup")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay on the adapter")
    grad_accum: int = Field(1, ge=1, le=4096, description="micro-batches per optimizer step")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="global gradient-norm clipping")
    eval_every: int = Field(
        0,
        ge=0,
        le=MAX_STEP_INTERVAL,
        description="steps between validation losses (0: only at epoch ends and the end)",
    )
    checkpoint_every: int | None = Field(
        None,
        ge=0,
        le=MAX_STEP_INTERVAL,
        description="steps between checkpoints; unset: LORAQ_CHECKPOINT_EVERY for a job, "
        "only at the end locally",
    )
    eval_prompts: list[EvalPrompt] | None = Field(
        None,
        max_length=MAX_EVAL_PROMPTS,
        description="answered greedily at every checkpoint, shown per checkpoint on the dashboard",
    )
    batch_scaling: BatchScaling = Field(
        "global",
        description="with several GPUs (n_gpus × n_nodes ranks): global splits batch_size over them; "
        "per_gpu gives each rank batch_size rows (global batch batch_size × ranks, that many times "
        "fewer steps an epoch) and scales the learning rate by √ranks (the square-root rule for "
        "Adam, Malladi et al. 2022). On one GPU both are the same",
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
    n_nodes: int = Field(
        1,
        ge=1,
        le=MAX_NODES,
        description="hosts one job spans: > 1 runs it on that many workers of its queue at once, "
        "n_gpus each, joined by torchrun's c10d rendezvous",
    )


class DpoHyperparameters(Hyperparameters):
    """OpenAI's DPO hyperparameters (`method.dpo.hyperparameters`): the supervised three and beta."""

    beta: Beta = Field(
        "auto",
        description="DPO's beta: how far the adapter may move from the base (higher: closer); "
        f"auto: {AUTO_DPO_BETA}",
    )
    rpo_alpha: RpoAlpha = Field("auto", description=RPO_ALPHA_DESCRIPTION)


class SupervisedTraining(Strict):
    """Supervised fine-tuning: next-token cross-entropy on the assistant's (completion's) tokens."""

    type: Literal["supervised"] = "supervised"


class DpoTraining(Strict):
    """Direct Preference Optimization on preference pairs: the sigmoid loss averaged over the step's
    pairs, plus α times the chosen answers' NLL per token (RPO; TRL's rpo_alpha):

        L = mean_pairs -log σ(β · ((log π(y_w|x) - log π_ref(y_w|x)) - (log π(y_l|x) - log π_ref(y_l|x))))
            + α · Σ_chosen tokens -log π(y_w,t | x, y_w,<t) / (the step's chosen tokens)

    π_ref is the base with the adapter switched off."""

    type: Literal["dpo"] = "dpo"
    beta: Beta = Field("auto", description=f"auto: {AUTO_DPO_BETA}")
    rpo_alpha: RpoAlpha = Field("auto", description=RPO_ALPHA_DESCRIPTION)

    @property
    def beta_value(self) -> float:
        return AUTO_DPO_BETA if self.beta == "auto" else float(self.beta)

    @property
    def rpo_alpha_value(self) -> float:
        return AUTO_RPO_ALPHA if self.rpo_alpha == "auto" else float(self.rpo_alpha)


# The training method, one typed value from the request (service.jobs.requested_training) through
# the job row and the worker's claim to the engine (TrainConfig.method).
TrainingMethod = Annotated[SupervisedTraining | DpoTraining, Field(discriminator="type")]
MethodType = Literal["supervised", "dpo"]
METHOD_TYPES: tuple[MethodType, ...] = ("supervised", "dpo")


class TrainingConfig(Hyperparameters, TrainingOptions):
    """Every training field, flat, and the training method (supervised or DPO with its beta)."""

    method: TrainingMethod = Field(default_factory=SupervisedTraining, description="supervised or dpo")

    def hyperparameter_block(self) -> Hyperparameters:
        """OpenAI's part, as a job shows it under `hyperparameters`."""
        return Hyperparameters(**{name: getattr(self, name) for name in Hyperparameters.model_fields})


@dataclass(frozen=True)
class DataShape:
    """What `plan_auto` needs to know of the examples a run trains on (after the holdout)."""

    examples: int
    tokens: int  # of all those examples, one epoch
    longest: int  # tokens of the longest example


@dataclass(frozen=True)
class AutoPlan:
    """A run's hyperparameters with "auto" resolved, the packed row length it trains on, and why."""

    n_epochs: int
    batch_size: int  # rows per micro-batch
    learning_rate_multiplier: float
    row_tokens: int  # a packed row holds at most this many tokens (max_seq_len unless auto shortened it)
    reason: str  # one sentence for the job's events and the dry run
    world_size: int = 1  # ranks the run is planned for (n_gpus × n_nodes)
    batch_scaling: BatchScaling = "global"  # per_gpu: batch_size is each rank's rows

    @property
    def global_batch(self) -> int:
        """Rows of one micro-batch over all ranks: what the engine samples and counts steps by."""
        return global_batch(self.batch_size, self.world_size, self.batch_scaling)

    @property
    def learning_rate(self) -> float:
        """The peak learning rate the run trains at (√ranks × the requested one in per_gpu mode)."""
        scale = lr_scale(self.world_size, self.batch_scaling)
        return BASE_LEARNING_RATE * self.learning_rate_multiplier * scale

    def hyperparameters(self) -> dict[str, int | float]:
        """OpenAI's three, as a job shows them once planned (not range-checked: a local run's
        absolute learning_rate may be any multiple of the base rate)."""
        return {
            "n_epochs": self.n_epochs,
            "batch_size": self.batch_size,
            "learning_rate_multiplier": self.learning_rate_multiplier,
        }


def plan_job(config: TrainingConfig, data: DataShape, *, world_size: int = 1) -> AutoPlan:
    """`plan_auto` for a job's (or a YAML file's) training configuration."""
    return plan_auto(
        data,
        n_epochs=config.n_epochs,
        batch_size=config.batch_size,
        learning_rate_multiplier=config.learning_rate_multiplier,
        max_seq_len=config.max_seq_len,
        packing=config.packing,
        grad_accum=config.grad_accum,
        world_size=world_size,
        batch_scaling=config.batch_scaling,
    )


def global_batch(batch_size: int, world_size: int, batch_scaling: BatchScaling) -> int:
    """A micro-batch's rows over all `world_size` ranks: batch_size itself (global), or batch_size
    on each rank (per_gpu)."""
    return batch_size * world_size if batch_scaling == "per_gpu" else batch_size


def lr_scale(world_size: int, batch_scaling: BatchScaling) -> float:
    """What per_gpu mode multiplies the learning rate by: √world_size. Its global batch is
    world_size× one rank's, and for Adam-type optimizers (AdamW here) the square-root scaling rule
    keeps the training dynamics of the smaller batch: batch ×k, learning rate ×√k (Malladi,
    Lyu, Panigrahi, Arora 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms",
    NeurIPS; SGD's rule is linear instead). Global mode keeps the batch, so the rate too."""
    return math.sqrt(world_size) if batch_scaling == "per_gpu" else 1.0


def auto_epochs(examples: int) -> int:
    """OpenAI's rule: 3 epochs, more for a small file, fewer for a large one (module docstring)."""
    n = max(examples, 1)
    if n * AUTO_N_EPOCHS < AUTO_MIN_EXAMPLES_SEEN:
        return min(AUTO_MAX_EPOCHS, -(-AUTO_MIN_EXAMPLES_SEEN // n))
    if n * AUTO_N_EPOCHS > AUTO_MAX_EXAMPLES_SEEN:
        return max(1, AUTO_MAX_EXAMPLES_SEEN // n)
    return AUTO_N_EPOCHS


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_auto(
    data: DataShape,
    *,
    n_epochs: int | Auto,
    batch_size: int | Auto,
    learning_rate_multiplier: float | Auto,
    max_seq_len: int,
    packing: bool,
    grad_accum: int = 1,
    world_size: int = 1,
    batch_scaling: BatchScaling = "global",
) -> AutoPlan:
    """Resolve the "auto" hyperparameters for `data` (the rule is the module docstring's). Numbers
    given are kept; the rows stay max_seq_len long unless batch_size is auto. `world_size` GPUs
    each take at least one row of a step. In per_gpu mode auto picks each rank's rows: the same
    aim of AUTO_MIN_STEPS steps, a step being world_size ranks' rows."""
    per_gpu = batch_scaling == "per_gpu"
    # ranks that share one batch_size (global mode), and ranks whose rows make one step
    sharing, ranks_a_step = (1, world_size) if per_gpu else (world_size, 1)
    seq = max_seq_len
    lr_mult = (
        AUTO_LEARNING_RATE_MULTIPLIER
        if learning_rate_multiplier == "auto"
        else float(learning_rate_multiplier)
    )
    row_tokens = seq
    why: list[str] = []
    epochs = auto_epochs(data.examples) if n_epochs == "auto" else int(n_epochs)
    if n_epochs == "auto" and epochs > AUTO_N_EPOCHS:
        why.append(
            f"{epochs} epochs so that {data.examples} examples are seen {AUTO_MIN_EXAMPLES_SEEN}+ times"
        )
    elif n_epochs == "auto" and epochs < AUTO_N_EPOCHS:
        why.append(
            f"{epochs} epoch(s) so that {data.examples:,} examples are seen "
            f"at most {AUTO_MAX_EXAMPLES_SEEN:,} times"
        )
    elif n_epochs == "auto":
        why.append(f"{epochs} epochs (auto)")
    if batch_size != "auto":
        batch = int(batch_size)
    else:
        # the tokens one micro-batch should carry for AUTO_MIN_STEPS steps, within [longest, 4 rows]
        step_tokens = -(-epochs * data.tokens // (AUTO_MIN_STEPS * grad_accum * ranks_a_step))
        if not packing:
            per_example = max(1, data.tokens // max(data.examples, 1))
            batch = max(sharing, min(AUTO_BATCH_SIZE, step_tokens // per_example))
            why.append(f"{batch} example(s) a step, so that the run makes at least {AUTO_MIN_STEPS} steps")
        elif step_tokens >= seq:
            batch = max(sharing, min(AUTO_BATCH_SIZE, step_tokens // seq))
            why.append(
                f"{batch} row(s) of {seq} tokens a step"
                + (
                    f" (auto takes up to {AUTO_BATCH_SIZE}; fewer so that the run makes at least "
                    f"{AUTO_MIN_STEPS} steps)"
                    if batch < AUTO_BATCH_SIZE
                    else ""
                )
            )
        else:  # a small file: shorter packed rows, one a step (per GPU)
            batch = sharing
            per_row = -(-step_tokens // sharing)
            # rounded down, so rows are no longer than the aim (the step count stays at or above it)
            aim = per_row // AUTO_ROW_MULTIPLE * AUTO_ROW_MULTIPLE
            row_tokens = min(seq, max(_round_up(max(data.longest, 1), AUTO_ROW_MULTIPLE), aim))
            why.append(
                f"packed rows of up to {row_tokens} tokens, {batch} a step, so that the run makes at "
                f"least {AUTO_MIN_STEPS} steps (a small file in full {seq}-token rows would be a few)"
            )
    if learning_rate_multiplier == "auto":
        why.append("the learning rate is the usual LoRA one (auto)")
    if per_gpu and world_size > 1:
        why.append(
            f"batch_scaling per_gpu: {batch} row(s) on each of {world_size} GPUs, a global batch of "
            f"{batch * world_size}, so {world_size}x fewer steps an epoch; the learning rate x "
            f"sqrt({world_size}) = {math.sqrt(world_size):.3g} by the square-root rule for Adam "
            "(Malladi et al. 2022, On the SDEs and Scaling Rules for Adaptive Gradient Algorithms)"
        )
    elif per_gpu:
        why.append("batch_scaling per_gpu on one GPU: the same as global")
    elif world_size > 1:
        why.append(
            f"batch_scaling global: the {batch} row(s) split over {world_size} GPUs"
            # measured (bench/straggler.py, multi-gpu-[x4-]batch<B>-h100-2026-11-28.json): a step
            # waits for its slowest GPU, packed rows differ in attention work, and a GPU with
            # fewer rows runs its GEMMs less efficiently (llama-1b, 4 GPUs: 3.70x at 4 rows each)
            + (
                f", up to {-(-batch // world_size)} row(s) a GPU: each step lasts as long as its "
                f"slowest GPU's rows, so {world_size} GPUs gain less than {world_size}x (llama-1b on "
                "4 H100s: 3.3x at 1 row a GPU, 3.55x at 2, 3.7x at 4); batch_size "
                f"{MULTI_GPU_ROWS_PER_GPU * world_size} or more, or batch_scaling per_gpu, keeps them busier"
                if batch < MULTI_GPU_ROWS_PER_GPU * world_size
                else ""
            )
        )
    reason = "; ".join(why) if why else "every hyperparameter set by the request"
    return AutoPlan(epochs, batch, lr_mult, row_tokens, reason, world_size, batch_scaling)


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


def plan_sentence(data: DataShape, *, rows: int, steps: int, plan: AutoPlan) -> str:
    """The plan as a job's first training event and its dry run say it."""
    batch = (
        f"{plan.batch_size} row(s) per GPU x {plan.world_size} GPUs = {plan.global_batch} row(s)"
        if plan.batch_scaling == "per_gpu" and plan.world_size > 1
        else f"{plan.batch_size} row(s)"
    )
    return (
        f"{data.examples:,} examples, {data.tokens:,} tokens in {rows:,} rows -> {steps:,} optimizer "
        f"steps over {plan.n_epochs} epoch(s), {batch} of up to {plan.row_tokens} "
        f"tokens a micro-batch, peak learning rate {plan.learning_rate:.1e}; "
        f"because: {plan.reason}"
    )
