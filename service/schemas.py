"""Request and response models of the REST API, in OpenAI's shapes.

Request models forbid unknown fields, and none of them has an owner, status or id field, so a
client cannot set those. A job's training fields are not declared here: `JobCreate` and
`JobPublic` are built from worker/engine/training_config.py, where each has its default and range.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from service.integrations import Integration, Integrations
from service.job_status import JobStatus
from worker.engine.training_config import (
    DpoHyperparameters,
    Hyperparameters,
    Placement,
    Strict,
    Text,
    TrainingOptions,
)

MetadataKey = Annotated[Text, Field(max_length=64)]
MetadataValue = Annotated[Text, Field(max_length=512)]


class Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- requests


class SupervisedMethod(Strict):
    hyperparameters: Hyperparameters | None = None


class DpoMethod(Strict):
    hyperparameters: DpoHyperparameters | None = None


class Method(Strict):
    """OpenAI's `method`. `type` is any string here so that a method Loraq does not train
    (`reinforcement`) is answered 400 `unsupported_method` naming the supported ones
    (`service.jobs.requested_method`) rather than a schema error."""

    type: str = Field(
        "supervised", min_length=1, max_length=32, description="supervised or dpo", examples=["dpo"]
    )
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    # accepted only to be refused by name with the method (Loraq has no reinforcement fine-tuning)
    reinforcement: dict[str, Any] | None = None


class JobCreate(TrainingOptions, Placement):
    """OpenAI's job request. The training fields are `TrainingOptions` (Loraq's extensions, at the
    top level) and `Hyperparameters` (OpenAI's, nested), declared in worker/engine/training_config.py;
    `service.jobs.requested_training` joins them into the job's `TrainingConfig`."""

    model: str = Field(min_length=1, max_length=128)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(None, max_length=64)
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]*$")
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    integrations: Integrations | None = None  # service/integrations.py: where the worker logs the job
    # Loraq extension: validate and plan the job (service/dry_run.py) without queueing it
    dry_run: bool = False

    @field_validator("lora", mode="before")
    @classmethod
    def _null_lora_is_the_default(cls, value: Any) -> Any:
        """`"lora": null` has always meant the default adapter shape."""
        return {} if value is None else value


# ---------------------------------------------------------------- responses


class FilePublic(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None
    expires_at: int | None = None


class FilesPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[FilePublic]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class JobErrorPublic(BaseModel):
    code: str | None
    message: str
    param: str | None = None


class HyperparametersPublic(Hyperparameters):
    """A job's hyperparameters: as requested until the run is planned from its tokenized data, "auto"
    resolved from then on (as OpenAI shows them once a job starts)."""


class SupervisedPublic(BaseModel):
    hyperparameters: HyperparametersPublic


class DpoHyperparametersPublic(DpoHyperparameters):
    """A DPO job's hyperparameters: as `HyperparametersPublic`, with beta and rpo_alpha ("auto"
    resolved once the run is planned)."""


class DpoPublic(BaseModel):
    hyperparameters: DpoHyperparametersPublic


class MethodPublic(BaseModel):
    """A supervised job's method as OpenAI echoes it: its type and its hyperparameters."""

    type: Literal["supervised"] = "supervised"
    supervised: SupervisedPublic


class DpoMethodPublic(BaseModel):
    """A DPO job's method as OpenAI echoes it: its type and its hyperparameters (beta among them)."""

    type: Literal["dpo"] = "dpo"
    dpo: DpoPublic


class ProgressPublic(BaseModel):
    """Our extension: the latest step of a running or finished job."""

    step: int
    total_steps: int | None
    train_loss: float | None
    tokens_per_s: float | None  # real (non-padding) tokens per second
    eta_seconds: float | None
    padding_fraction: float | None = None  # share of the step's token slots that were padding


class JobPublic(TrainingOptions, Placement):
    """OpenAI's job object; Loraq's training fields (`TrainingOptions`, `Placement`) are extensions
    at its top level, as in the request, with the values the service chose for the unset ones."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None
    error: JobErrorPublic | None
    fine_tuned_model: str | None
    model: str
    organization_id: str
    status: JobStatus
    hyperparameters: HyperparametersPublic
    training_file: str
    validation_file: str | None
    result_files: list[str]
    trained_tokens: int | None
    seed: int
    estimated_finish: int | None
    integrations: list[Integration]
    metadata: dict[str, str] | None
    method: MethodPublic | DpoMethodPublic
    user_provided_suffix: str | None
    progress: ProgressPublic
    queue: str = "default"
    validation_split: float = 0.0  # the held-out share; 0 with a validation_file
    worker_id: str | None = None  # "host:gpu2:pid" (worker.launcher.worker_identity)
    # Loraq extensions: when training began (durations), and a cancel that a running job has been
    # asked for but not reached yet (its status stays `running` until the step ends)
    started_at: int | None = None
    cancel_requested: bool = False
    # Loraq extension: a pause a running job has been asked for but not reached yet
    pause_requested: bool = False
    # Loraq extension: why a queued job has not started, in words (tenant limit, no worker yet)
    waiting_for: str | None = None
    # Loraq extension: set on a job of a random-weight preset (it runs, for tests and benchmarks,
    # but learns nothing real), naming the real model a near-miss name was probably meant to be
    warning: str | None = None


class JobsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobPublic]
    has_more: bool


class EventPublic(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"]
    data: dict[str, Any] | None


class EventsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventPublic]
    has_more: bool


class CheckpointMetrics(BaseModel):
    """A checkpoint's numbers, named as OpenAI's checkpoint object names them. Losses are of the
    last step the checkpoint holds; the validation loss is over the whole held-out set, so it is
    also the `full_valid_loss`. Unknown keys in a stored record (its samples) are ignored."""

    step: int
    train_loss: float | None = None
    valid_loss: float | None = None
    full_valid_loss: float | None = None


class StoredCheckpointMetrics(CheckpointMetrics):
    """What the store keeps with a checkpoint: its metrics and the greedy answers to the job's
    eval_prompts at that step (shown on the dashboard, not in the OpenAI object)."""

    samples: list[str] = Field(default_factory=list)


class CheckpointPublic(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


class CheckpointsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointPublic]
    has_more: bool
    first_id: str | None
    last_id: str | None


class PlanPublic(BaseModel):
    """The step's memory plan on a GPU of one size (worker/engine/memory_plan.py): what the worker
    will pick there, and its predicted peak."""

    gpu_memory_gib: float
    fits: bool
    predicted_peak_gib: float
    limit_gib: float  # the share of the GPU the plan stays under (90 %)
    micro_batch_rows: int | None  # rows per forward pass; null: the whole micro-batch at once
    activation_checkpointing: Literal["none", "selective", "full"]
    offload_activations: bool
    plan: str  # in words


class MinGpuPublic(BaseModel):
    """The smallest common GPU (8, 12, 16, 24, 40, 48, 80, 141 GB: service/gpu_fit.py) a base's
    default job trains on in one precision, by the memory plan."""

    memory_gb: int | None  # null: none of them, not even 141 GB
    gpu: str  # "24 GB (RTX 4090 / L4)"
    plan: PlanPublic  # the default job's plan on that GPU (where none fits: on the largest)


class ModelPublic(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    # Loraq's extensions: random-init models (tests, benchmarks) say so in every listing; `use`
    # says what a base is for ("tests": tiny-llama, never a real fine-tune); `upstream` is the hub
    # id its adapters name as their base.
    random: bool = False
    description: str | None = None
    # In the model store now. A base model that is not local is downloaded by its first job when
    # `auto_pull` (LORAQ_AUTO_PULL); without it such a job is refused at submit until
    # `loraq models pull`. `auto_pull` is null for fine-tuned models, which are never pulled.
    local: bool = True
    auto_pull: bool | None = None
    use: Literal["fine-tuning", "tests", "benchmarks"] | None = None
    upstream: str | None = None
    # random weights (a preset, or an adapter trained on one): what a job or chat on it says
    warning: str | None = None
    # What a user picks a base by (fine-tunes: their base's): its family ("Qwen3"), parameter
    # count and context length (max_position_embeddings); null where not known yet (a Hub model
    # no job has named, whose config.json is not in the store)
    kind: Literal["pretrained", "random", "local", "hub"] | None = None
    family: str | None = None
    parameters: int | None = None
    context_length: int | None = None
    # Bases only: per precision ("bf16", "nf4", "int8"; "gguf" for a GGUF base), the smallest
    # common GPU the base trains on with the default job (LoRA r 16 on every linear layer, 4 rows
    # of the default max_seq_len, split and checkpointed as the worker's memory plan would), in GB
    # (null: none up to 141 GB); `min_gpu` says which cards and the plan there. Both null where
    # the base's shape is not known.
    min_gpu_memory_gb: dict[str, int | None] | None = None
    min_gpu: dict[str, MinGpuPublic] | None = None


class ModelsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelPublic]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every non-2xx answer."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries documenting the error body for `statuses`."""
    return {s: {"model": ErrorResponse} for s in statuses}


def error_response(status: int, when: str) -> dict[int | str, dict[str, Any]]:
    """One route's `responses` entry for `status` with the error body, saying when it answers it."""
    return {status: {"model": ErrorResponse, "description": when}}


# What every route that reads the database (all but health) and every route that writes may
# answer when the database or the disk fails (service/errors.py maps both)
DATABASE_UNAVAILABLE = error_response(
    503, "the database is unavailable (code database_unavailable; Retry-After)"
)
DISK_FULL = error_response(507, "the server's storage is full: nothing was stored (code disk_full)")


class HealthPublic(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(default_factory=dict)
    latency_ms: dict[str, float] = Field(default_factory=dict)  # each readiness check, timed


# ---------------------------------------------------------------- chat completions

MAX_COMPLETION_TOKENS = 32768
MAX_MESSAGES = 1024


class TextPart(Forbid):
    type: Literal["text"]
    text: Text


class FunctionDefinition(Forbid):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None


class ToolDefinition(Forbid):
    """OpenAI's `tools` entry: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1 << 20)  # a JSON object, as a string


class ToolCall(BaseModel):
    """A call an assistant message makes (OpenAI's `tool_calls` entry)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChunkToolCall(ToolCall):
    index: int  # its place in the message's calls


class ChatMessage(Forbid):
    """One message of a conversation. A `tool` message (a call's result) needs `tool_call_id` and
    `content`: refused here with a 400 naming the field (validated even when left out, so a missing
    one is caught); that the id answers a call made earlier in the conversation, once, the worker
    checks (worker.engine.dataset_rules.check_conversation, as for a training line). The OpenAPI
    schema cannot state a rule between two fields: tests/service/test_schemathesis.py counts a 400
    naming the field as this operation's documented answer (SEMANTIC_400)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # an assistant message that makes tool_calls may leave it out; a tool result may be "" (a call
    # that returned nothing), as a training line's may
    content: Text | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # an assistant's calls
    # a tool result: the call it answers
    tool_call_id: str | None = Field(None, max_length=256, validate_default=True)

    @field_validator("content")
    @classmethod
    def _tool_result_has_content(cls, v: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        if info.data.get("role") == "tool" and v is None:
            raise ValueError("a tool message needs content (the result of the call it answers)")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_result_names_its_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not (v and v.strip()):
            raise ValueError("a tool message needs a non-empty tool_call_id (the id of the call it answers)")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(Forbid):
    include_usage: bool = False


class ChatCompletionCreate(Forbid):
    """OpenAI's request body; fields Loraq cannot honour (n > 1, a tool_choice that forces a call)
    are refused. `tools` are rendered with the model's chat template and the calls it writes come
    back as `tool_calls` (worker/engine/tool_calls.py); `tool_choice` "none" leaves them out."""

    model: str = Field(min_length=1, max_length=255)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_COMPLETION_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COMPLETION_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: Text | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=4)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a 64-bit integer, as OpenAI's
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # OpenAI's: each generated token's log-probability, with the top_logprobs most likely tokens
    # at its position (log softmax of the model's logits, before temperature and top_p)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's bound; needs logprobs (chat.py)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobPublic(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobPublic] | None
    refusal: list[TokenLogprobPublic] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is only tool calls
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    # Loraq extensions (OpenAI clients ignore them): the model has random weights (its answers are
    # noise); the worker loaded the model for this request first, and how long that took
    warning: str | None = None
    notice: str | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    # as on ChatCompletion, on the first chunk only (absent from the others)
    warning: str | None = None
    notice: str | None = None


# ---------------------------------------------------------------- dry runs


class DatasetSummary(BaseModel):
    """A file as read: its valid examples (a job refuses a file with any invalid line)."""

    format: str | None
    examples: int
    tokens: int
    trainable_tokens: int
    max_tokens: int  # longest example


class TrainingData(BaseModel):
    """What the run trains on in each epoch: the training file's valid examples less those held
    out for validation, in the rows the job forms (packed: several examples a row)."""

    examples: int
    tokens: int
    trainable_tokens: int
    rows: int
    held_out_examples: int  # held out for the validation loss (no validation_file, ≥ 100 examples)


class DryRunError(BaseModel):
    param: str
    line: int | None = None  # 1-based line of the file, when the error is about one line
    message: str


class EstimatePublic(BaseModel):
    worker_class: str
    # the memory plan's predicted peak for this job's step on the class's GPU (memory_plan says
    # how: micro-batch rows, activation checkpointing); null where the class's GPU or the model's
    # shape is not known, `unavailable` says which
    peak_gpu_memory_gib: float | None
    # trained tokens over the class's benchmark tokens/s for the model; null, with `unavailable`
    # saying why, where the class has no benchmark row for the model or one near enough
    wall_seconds: float | None
    # how the tokens/s were scaled from a row of another model (a model, of any family, with no
    # row of its own); null: its own row
    basis: str | None = None
    source: str | None  # the benchmark result the wall time comes from
    unavailable: str | None = None
    memory_plan: PlanPublic | None = None


class MemoryPlanPublic(PlanPublic):
    """The plan on one GPU size of the queue's live workers."""

    workers: int  # live workers of the job's queue whose GPUs are this size


class DryRunPublic(BaseModel):
    """What a job would do, computed without queueing it (`"dry_run": true`)."""

    object: Literal["fine_tuning.job.dry_run"] = "fine_tuning.job.dry_run"
    model: str
    valid: bool
    training_file: DatasetSummary
    validation_file: DatasetSummary | None
    hyperparameters: HyperparametersPublic  # "auto" resolved from the tokenized examples
    max_seq_len: int
    row_tokens: int  # a packed row's length: max_seq_len, or shorter where auto made small steps
    plan: str  # the plan in words and why (the job's first training event says the same)
    packing: bool
    # the seed the holdout is drawn with (the request's, else drawn here): a job submitted with
    # it holds out the same examples; another seed holds out as many, maybe other ones
    seed: int
    validation_split: float  # the share held out (0 with a validation_file)
    # what the run validates on, in the words of the job's own event (worker/engine/holdout.py)
    validation: str
    training: TrainingData
    # how batch_size meets the job's n_gpus × n_nodes ranks ("global": split; "per_gpu": on each)
    batch_scaling: str
    global_batch_size: int  # rows of one micro-batch over all ranks
    learning_rate: float | None  # the peak rate the run trains at (per_gpu: × √ranks); None: no plan
    grad_accum: int
    micro_batches_per_epoch: int  # batches of batch_size rows per epoch (the last may be short)
    steps: int  # optimizer steps: grad_accum micro-batches each
    trained_tokens: int  # tokens the run trains on: every epoch sees every trained token
    estimates: list[EstimatePublic]
    # one per GPU size of the queue's live workers (empty: none known, or a model of unknown shape)
    memory: list[MemoryPlanPublic] = Field(default_factory=list)
    errors: list[DryRunError]
    latency_ms: dict[str, float] = Field(default_factory=dict)  # /readyz: how long each check took
