"""The engine's public contract: configuration, per-step metrics, callbacks, result, errors.

Pure Python (no torch import) so that the worker glue and tests can build configs cheaply.
The worker (worker/tasks.py) calls `worker.engine.recipe.train(config, callbacks)`; the engine
never knows about databases, queues or HTTP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from worker.engine.memory_plan import MemoryChoice
from worker.engine.training_config import (
    AUTO_BATCH_SIZE,
    AUTO_LEARNING_RATE_MULTIPLIER,
    AUTO_N_EPOCHS,
    BASE_LEARNING_RATE,
    LOCAL_N_EPOCHS,
    AutoPlan,
    BatchScaling,
    DataShape,
    SupervisedTraining,
    TrainingConfig,
    TrainingMethod,
    plan_auto,
)
from worker.engine.training_config import LoraConfig as LoraConfig  # re-exported for the engine
from worker.engine.training_config import QuantizationName as QuantizationName
from worker.engine.training_config import SchedulerName as SchedulerName

DeviceName = Literal["auto", "cpu", "cuda"]


# Each training field's default, from its one declaration
_DEFAULT = TrainingConfig()


@dataclass
class TrainConfig:
    """What one run of the engine does: a `TrainingConfig` in the engine's terms (an absolute
    learning rate, `pack`), plus its files and limits. The hyperparameters named in `auto` are
    planned from the tokenized data when the run starts (`planned`, `plan_auto`); until then their
    fields hold the data-free defaults."""

    model: str
    train_file: Path
    output_dir: Path
    model_store: Path
    validation_file: Path | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    max_seq_len: int = _DEFAULT.max_seq_len
    batch_size: int = AUTO_BATCH_SIZE
    grad_accum: int = _DEFAULT.grad_accum
    n_epochs: int = LOCAL_N_EPOCHS  # a run built in code (or from YAML) makes one pass unless told
    max_steps: int | None = None
    learning_rate: float = BASE_LEARNING_RATE * AUTO_LEARNING_RATE_MULTIPLIER
    weight_decay: float = _DEFAULT.weight_decay
    lr_scheduler: SchedulerName = _DEFAULT.lr_scheduler
    warmup_ratio: float = _DEFAULT.warmup_ratio
    max_grad_norm: float = _DEFAULT.max_grad_norm
    seed: int = 0
    pack: bool = _DEFAULT.packing  # padding-free: examples packed into rows of max_seq_len tokens
    quantization: QuantizationName | None = None  # the frozen base's storage (worker/engine/quantize.py)
    # micro-batch rows, activation checkpointing, offload (worker/engine/step_memory.py); None:
    # planned for the GPU's free memory when the run starts (nothing on the CPU)
    memory: MemoryChoice | None = None
    # Without a validation_file, hold out this share of the examples for the validation loss (at
    # most HOLDOUT_MAX_EXAMPLES, only from HOLDOUT_MIN_EXAMPLES examples on: worker/engine/data.py);
    # 0 = train on everything. The service passes LORAQ_VALIDATION_SPLIT (0.05) or the job's value.
    validation_split: float = 0.0
    eval_every: int = _DEFAULT.eval_every  # steps between validation losses (and at epoch ends, the end)
    checkpoint_every: int = 0  # 0 = only at the end
    checkpoint_each_epoch: bool = False  # also at every epoch end
    checkpoint_interval_seconds: float = 0.0  # also once this much training time passed (0 = off)
    resume_from: Path | None = None
    device: DeviceName = "auto"
    # limits (reliability issue): exceeding one fails the run with the reason, checkpoints kept
    max_tokens: int | None = None
    max_wall_seconds: float | None = None
    step_limit: int | None = None  # a run planned for more optimizer steps fails before training
    # sampled greedily (as single-turn user chats) at every checkpoint, so a user sees behaviour change
    eval_prompts: list[str] = field(default_factory=list)
    # "n_epochs", "batch_size", "learning_rate": left to `plan_auto`, which sees the data
    auto: tuple[str, ...] = ()
    # a packed training row holds at most this many tokens; None: max_seq_len (auto may shorten it)
    row_tokens: int | None = None
    # supervised (cross-entropy on the trained tokens) or DPO (preference pairs, its beta)
    method: TrainingMethod = field(default_factory=SupervisedTraining)
    # per_gpu: batch_size is each rank's rows and the learning rate is scaled by √ranks, until
    # `planned` folds both into batch_size (global rows) and learning_rate
    batch_scaling: BatchScaling = _DEFAULT.batch_scaling

    def plan(self, data: DataShape, *, world_size: int = 1) -> AutoPlan:
        """The run's hyperparameters for `data`: "auto" ones planned, the others as set."""
        plan = plan_auto(
            data,
            n_epochs="auto" if "n_epochs" in self.auto else self.n_epochs,
            batch_size="auto" if "batch_size" in self.auto else self.batch_size,
            learning_rate_multiplier="auto"
            if "learning_rate" in self.auto
            else self.learning_rate / BASE_LEARNING_RATE,
            max_seq_len=self.max_seq_len,
            packing=self.pack,
            grad_accum=self.grad_accum,
            world_size=world_size,
            batch_scaling=self.batch_scaling,
        )
        if "batch_size" in self.auto:
            return plan
        return replace(plan, row_tokens=self.row_tokens or self.max_seq_len)  # as planned before, if it was

    def planned(self, plan: AutoPlan) -> TrainConfig:
        """This config with `plan`'s numbers in place of "auto" (nothing left to plan), in the
        engine's terms: batch_size the global rows of a micro-batch, split over the ranks, and the
        learning rate the one it trains at (per_gpu's √ranks applied, so batch_scaling is global)."""
        return replace(
            self,
            n_epochs=plan.n_epochs,
            batch_size=plan.global_batch,
            learning_rate=plan.learning_rate,
            batch_scaling="global",
            # rows keep their length unless auto chose the batch (then rows are part of the plan)
            row_tokens=plan.row_tokens if plan.row_tokens != self.max_seq_len else None,
            auto=(),
        )

    @classmethod
    def build(cls, training: TrainingConfig, **run: Any) -> TrainConfig:
        """The engine's config for `training` ("auto" kept for the run to plan from its data; an
        unset seed, validation_split or checkpoint_every takes the engine's default below) plus the
        run's fields (`model`, files, limits, ...) given as keywords."""
        names = {f.name for f in fields(cls)} - {"eval_prompts"}
        options = {k: v for k, v in training.options().items() if v is not None and k in names}
        lr = training.learning_rate_multiplier
        return cls(
            **options,
            n_epochs=AUTO_N_EPOCHS if training.n_epochs == "auto" else int(training.n_epochs),
            batch_size=AUTO_BATCH_SIZE if training.batch_size == "auto" else int(training.batch_size),
            learning_rate=BASE_LEARNING_RATE * (AUTO_LEARNING_RATE_MULTIPLIER if lr == "auto" else float(lr)),
            pack=training.packing,
            eval_prompts=list(training.eval_prompts or []),
            method=training.method,
            auto=tuple(
                name
                for name, value in (
                    ("n_epochs", training.n_epochs),
                    ("batch_size", training.batch_size),
                    ("learning_rate", lr),
                )
                if value == "auto"
            ),
            **run,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, Path):
                d[k] = str(v)
        d["lora"] = self.lora.model_dump()
        d["method"] = self.method.model_dump()
        return d


@dataclass
class PreferenceMetrics:
    """A DPO step's (or validation pass's) readings, means over its pairs (TRL's rewards/*):
    r = β · (log π(answer) - log π_ref(answer)) of the chosen and the rejected answer."""

    chosen_reward: float
    rejected_reward: float
    margin: float  # chosen_reward - rejected_reward
    accuracy: float  # share of pairs whose chosen reward is above the rejected one
    # the chosen answers' NLL per token under the policy (TRL's nll_loss; the loss adds it × rpo_alpha)
    chosen_nll: float | None = None


@dataclass
class StepMetrics:
    step: int  # 1-based optimizer step
    total_steps: int
    epoch: float
    train_loss: float
    lr: float
    grad_norm: float
    tokens: int  # tokens in this step (all micro-batches)
    trained_tokens: int  # cumulative
    tokens_per_s: float
    step_seconds: float
    eta_seconds: float
    valid_loss: float | None = None
    # share of the token slots the step computed on that were padding (0 = padding-free)
    padding_fraction: float = 0.0
    # DPO only: the step's readings, and the validation pass's where one ran (its loss: valid_loss)
    preference: PreferenceMetrics | None = None
    valid_preference: PreferenceMetrics | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StepMetrics:
        """A step from its `dataclasses.asdict` record (what a torchrun rank writes)."""
        nested = {
            key: PreferenceMetrics(**record[key]) if record.get(key) else None
            for key in ("preference", "valid_preference")
        }
        return cls(**{**record, **nested})


@dataclass
class CheckpointInfo:
    step: int
    path: Path  # a directory holding a PEFT adapter plus training state
    # greedy answers to TrainConfig.eval_prompts at this step, in the same order
    samples: list[str] = field(default_factory=list)


@dataclass
class TrainResult:
    adapter_dir: Path  # PEFT layout: adapter_model.safetensors + adapter_config.json
    steps: int
    trained_tokens: int
    final_train_loss: float
    final_valid_loss: float | None
    checkpoints: list[CheckpointInfo]
    stopped: bool = False  # True when should_stop() ended the run early


EventLevel = Literal["info", "warn", "error"]


class TrainingCallbacks(Protocol):
    def on_step(self, metrics: StepMetrics) -> None: ...
    # `data` carries what a reader needs beyond the words: a health warning's {"health": kind, "step"}
    def on_event(self, level: EventLevel, message: str, data: dict[str, Any] | None = None) -> None: ...
    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None: ...
    def should_stop(self) -> bool: ...


class NullCallbacks:
    """Callbacks that do nothing; handy for tests and the CLI's base class."""

    def on_step(self, metrics: StepMetrics) -> None:
        return None

    def on_event(self, level: EventLevel, message: str, data: dict[str, Any] | None = None) -> None:
        return None

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        return None

    def should_stop(self) -> bool:
        return False


class StopRequested(Exception):
    """`callbacks.should_stop()` said stop while the run was being set up (its data tokenized and
    packed): `recipe.train` returns a stopped result that trained nothing."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose. `code` is stable for API mapping."""

    code = "engine_error"
    param: str | None = None


class NodeFailed(EngineError):
    """A job on several hosts lost one of them (a rank died, a host vanished, or not every host
    joined in time): the attempt ends, and the job may resume from its last checkpoint."""

    code = "node_failed"

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail  # torchrun's output on this host, for the worker's log


@dataclass(frozen=True)
class Rendezvous:
    """How one host of a job on several hosts joins the others: torchrun's c10d rendezvous, whose
    store the first host (the worker that claimed the job) serves at `endpoint`.

    The rendezvous numbers the hosts itself (by address), so global rank 0 may be on any of them:
    each host's worker forwards what its rank 0 writes, and only one host's has one. Every rank
    exits when one dies (`--max-restarts=0`: a lost peer fails its collective; no restart in place,
    the attempt ends and the job resumes from its last checkpoint on a new set of hosts).
    """

    endpoint: str  # "host:port" of the c10d store, on the first host
    run_id: str  # the same on every host of one attempt, another for the next attempt
    n_nodes: int
    local_addr: str  # the address the other hosts reach this one at (the store's, rank 0's)
    is_host: bool  # this host serves the store
    join_timeout_s: float

    def torchrun_args(self) -> list[str]:
        conf = f"is_host={int(self.is_host)},join_timeout={max(1, round(self.join_timeout_s))}"
        return [
            f"--nnodes={self.n_nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}", f"--rdzv-conf={conf}", f"--local-addr={self.local_addr}",
            "--max-restarts=0",
        ]  # fmt: skip


@dataclass
class LineError:
    line: int  # 1-based line number in the JSONL file
    reason: str


class DatasetError(EngineError):
    code = "invalid_training_file"

    def __init__(self, errors: list[LineError], file_label: str = "training_file") -> None:
        self.errors = errors
        self.param = file_label
        shown = "; ".join(f"line {e.line}: {e.reason}" for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        super().__init__(f"{file_label} has {len(errors)} invalid line(s): {shown}{more}")


class ModelError(EngineError):
    code = "invalid_model"
    param = "model"


LOWER_LR_HINT = "lower the learning rate (learning_rate_multiplier) or raise warmup"


class DivergedError(EngineError):
    """Training blew up: a NaN/inf loss or gradient, or the loss far above where it started."""

    code = "diverged"
    param = "hyperparameters.learning_rate_multiplier"

    def __init__(self, step: int, what: str) -> None:
        self.step = step
        super().__init__(f"training diverged at step {step}: {what}; {LOWER_LR_HINT}")


class NonFiniteError(DivergedError):
    def __init__(self, step: int, what: str = "loss") -> None:
        stopped = "run stopped before the optimizer step, last good checkpoint kept"
        super().__init__(step, f"non-finite {what} ({stopped})")


class LimitExceeded(EngineError):
    code = "limit_exceeded"


class KernelUnavailableError(EngineError):
    """A GPU is present but the compiled kernels failed to build: refuse to train slowly."""

    code = "kernels_unavailable"


class ConfigError(EngineError):
    """A training configuration field is missing, unknown, of the wrong type or out of range."""

    code = "invalid_config"

    def __init__(self, field: str, message: str) -> None:
        self.param = field
        self.field = field
        super().__init__(message)


class RequestError(EngineError):
    """A serving request the model cannot run (prompt longer than the context, unknown adapter
    layout); `param` names the request field."""

    code = "invalid_request"

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)
