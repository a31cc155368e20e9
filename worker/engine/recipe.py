"""The LoRA fine-tuning recipe: setup → train → save_checkpoint → cleanup.

One optimizer step consumes `grad_accum` micro-batches of `batch_size` rows. The loss of a step is

    L = Σ_micro Σ_tokens CE(logits_t, label_t) / N,    N = trainable tokens of all its micro-batches

so accumulating k micro-batches of b rows gives the same gradient as one batch of k·b rows.
Gradients flow only into the LoRA factors (fp32); the base model is frozen (bf16 on CUDA under
bf16 autocast, fp32 on CPU). On CPU a run is a pure function of the config (seeded init, seeded
data order), and a run resumed from a checkpoint continues the uninterrupted run bit for bit.

The engine knows nothing of databases: progress goes out through `TrainingCallbacks`, and
cancellation comes in through `callbacks.should_stop()`, checked before every step and, while the
data is prepared, between chunks of tokenizing and packing (`StopRequested`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn
from transformers import PreTrainedModel

import gpu_kernels
from worker.engine import distributed
from worker.engine.checkpoint import (
    TRAINING_STATE,
    TrainingState,
    checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from worker.engine.config_file import validate_config
from worker.engine.data import (
    IGNORE_INDEX,
    Batch,
    BatchSampler,
    load_dataset,
    planned_datasets,
    read_valid_examples,
)
from worker.engine.dataset_rules import PREFERENCE_FORMAT
from worker.engine.export import export_adapter
from worker.engine.fused_model import FuseReport, fuse_model, fused_stack, lm_loss_sum
from worker.engine.health import Finding, HealthMonitor
from worker.engine.holdout import holdout_sentence
from worker.engine.lora import apply_lora, lora_modules, remove_lora, trainable_parameters
from worker.engine.models import LoadedModel, load_base_model
from worker.engine.sampling import greedy_samples
from worker.engine.schedule import build_scheduler, warmup_steps
from worker.engine.step_memory import expandable_segments, obey, offloaded, remove_checkpointing, split_rows
from worker.engine.train_step import CapturedTrainStep, HostStep, StepObjective, StepShape, host_step
from worker.engine.training_config import plan_sentence, plan_steps
from worker.engine.types import (
    CheckpointInfo,
    ConfigError,
    DivergedError,
    KernelUnavailableError,
    LimitExceeded,
    NonFiniteError,
    StepMetrics,
    StopRequested,
    TrainConfig,
    TrainingCallbacks,
    TrainResult,
)

ADAPTER_DIR = "adapter"
STOP_CHECK_EVERY = 4096  # micro-batches sized between two should_stop questions (_step_shape)
log = logging.getLogger(__name__)


class _PrepProgress:
    """How far the training file's tokenizing is: an event when it starts and at each tenth of the
    file (a 512 MB file takes many minutes on a few cores), a log line every `LOG_EVERY_S`."""

    LOG_EVERY_S = 5.0

    def __init__(self, callbacks: TrainingCallbacks, total: int) -> None:
        self.callbacks, self.total = callbacks, max(total, 1)
        self.tenths = 0
        self.logged = time.monotonic()
        callbacks.on_event("info", f"Preparing data: tokenizing training_file ({total / 2**20:.1f} MiB)")

    def __call__(self, done: int) -> None:
        tenths = done * 10 // self.total
        if self.tenths < tenths < 10:
            self.tenths = tenths
            self.callbacks.on_event("info", f"Preparing data: {tenths * 10}% of training_file tokenized")
        if (now := time.monotonic()) - self.logged >= self.LOG_EVERY_S:
            self.logged = now
            log.info("data: %d of %d bytes of training_file tokenized", done, self.total)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "device is 'cuda' but no CUDA GPU is available")
    return torch.device(name)


def find_checkpoint(path: Path) -> Path:
    """`resume_from` may name a checkpoint directory or a directory holding exactly one (an unzipped
    checkpoint archive); return the checkpoint directory itself."""
    if (path / TRAINING_STATE).is_file():
        return path
    found = sorted(p.parent for p in path.glob(f"*/{TRAINING_STATE}"))
    if len(found) == 1:
        return found[0]
    raise ConfigError("resume_from", f"resume_from {path} holds no checkpoint ({TRAINING_STATE} not found)")


@dataclass
class _Launched:
    """A captured step queued on the GPU whose loss and gradient norm are not read yet."""

    micro: list[Batch]
    started: float  # monotonic time this step's own time starts (its report's step_seconds)
    # (2 + READINGS,) fp32 loss, grad norm (and a DPO step's readings): pinned host memory, valid
    # once `done` ran
    values: torch.Tensor
    done: torch.cuda.Event | None  # recorded after the copy into `values` (None off CUDA)


class LoRAFinetuneRecipe:
    """The supervised recipe, and the method-independent loop (schedule, health, validation,
    checkpoints, limits, run-ahead) that the DPO recipe (worker/engine/dpo.py) shares: it overrides
    the objective's hooks (`_check_format`, `_prepare_method`, `_objective`, `_host_step`,
    `_eager_step`, `evaluate`, `_method_metrics`). The step's shape counts pairs for it (Q)."""

    READINGS = 0  # numbers a step reports beside its loss and gradient norm (DPO: its rewards)

    def __init__(
        self, config: TrainConfig, callbacks: TrainingCallbacks, *, loaded: LoadedModel | None = None
    ) -> None:
        self.config = config
        self.callbacks = callbacks
        self._given = loaded
        self.loaded: LoadedModel | None = None
        self.checkpoints: list[CheckpointInfo] = []
        self._last_checkpoint_step = -1
        self._last_checkpoint_time = time.monotonic()
        self.dist = distributed.SINGLE
        self._launches = 0
        self._readback: list[torch.Tensor] = []

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.config
        validate_config(cfg)
        self.device = resolve_device(cfg.device)
        # Under torchrun (WORLD_SIZE > 1): join the group, train on cuda:LOCAL_RANK, and let only
        # rank 0 report. A no-op in one process. See worker/engine/distributed.py.
        self.dist, self.device = distributed.init_from_env(self.device)
        self.callbacks = distributed.wrap_callbacks(self.callbacks, self.dist)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda:
            expandable_segments()  # before the base's weights take their segments
            try:
                gpu_kernels.require_compiled()
            except RuntimeError as exc:
                raise KernelUnavailableError(str(exc)) from exc
        dtype = torch.bfloat16 if self.on_cuda else torch.float32
        self.started = time.monotonic()

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.loaded = self._base_model(dtype)
        if self.loaded.note:  # a quantized base: what quantizing it did (its weight error)
            self.callbacks.on_event("info", self.loaded.note)
        model = self.model
        tokenizer = self.loaded.tokenizer

        # The run is planned from the examples it trains on ("auto" resolved: plan_auto), then
        # those are formed into rows of the plan's length. Tokenized a chunk at a time into compact
        # arrays (data.Examples), asking should_stop between chunks: a cancel ends the run here too.
        stop = self.callbacks.should_stop
        prepared = time.monotonic()
        progress = _PrepProgress(self.callbacks, cfg.train_file.stat().st_size)
        examples, fmt = read_valid_examples(
            cfg.train_file, tokenizer, cfg.max_seq_len, should_stop=stop, progress=progress
        )
        self._check_format(fmt, "training_file")
        planned = planned_datasets(
            examples,
            tokenizer,
            cfg.max_seq_len,
            fmt,
            pack=cfg.pack,
            # without a validation file, hold some examples out (seeded) for a validation curve
            holdout=0.0 if cfg.validation_file is not None else cfg.validation_split,
            seed=cfg.seed,
            planner=lambda shape: cfg.plan(shape, world_size=self.dist.world_size),
            should_stop=stop,
        )
        self.config = cfg = cfg.planned(planned.plan)
        self.train_data, self.valid_data = planned.train, planned.held_out
        if cfg.validation_file is not None:
            self.valid_data = load_dataset(
                cfg.validation_file,
                tokenizer,
                cfg.max_seq_len,
                pack=cfg.pack,
                file_label="validation_file",
                should_stop=stop,
            )
            self._check_format(self.valid_data.format, "validation_file")
        log.info(
            "data prepared in %.1fs: %d examples, %.1f MiB of arrays",
            time.monotonic() - prepared,
            len(examples),
            examples.nbytes / 2**20,
        )
        self.sampler = BatchSampler(self.train_data, cfg.batch_size, cfg.seed)
        plan = plan_steps(
            len(self.train_data),
            batch_size=cfg.batch_size,
            n_epochs=cfg.n_epochs,
            grad_accum=cfg.grad_accum,
            max_steps=cfg.max_steps,
        )
        self.batches_per_epoch = plan.micro_batches_per_epoch
        self.total_micro_batches, self.total_steps = plan.micro_batches, plan.steps
        # the plan in words, once the data is ready; its data is the job's resolved hyperparameters
        self.callbacks.on_event(
            "info",
            "Plan: "
            + plan_sentence(
                planned.shape, rows=len(self.train_data), steps=self.total_steps, plan=planned.plan
            ),
            {
                "hyperparameters": planned.plan.hyperparameters(),
                "row_tokens": planned.plan.row_tokens,
                "global_batch_size": planned.plan.global_batch,
                "learning_rate": planned.plan.learning_rate,
            },
        )
        self.health = HealthMonitor(
            warmup_steps=warmup_steps(self.total_steps, cfg.warmup_ratio), method=cfg.method.type
        )
        if cfg.step_limit is not None and self.total_steps > cfg.step_limit:
            # Known before the first step: fail now rather than train up to the limit and stop.
            raise LimitExceeded(
                f"the run needs {self.total_steps} optimizer steps, over the step limit of {cfg.step_limit}"
                " (fewer epochs, a larger batch_size or max_steps)"
            )

        # LoRA init draws from the seeded generator here, independent of what loading consumed.
        torch.manual_seed(cfg.seed)
        layers = apply_lora(model, cfg.lora)
        # GPU fast path: fused RMSNorm/SwiGLU modules, grouped q/k/v and gate/up LoRA.
        # A no-op unless gpu_kernels' compiled path is active, so CPU runs are unchanged.
        report = fuse_model(model)
        self.params = trainable_parameters(model)
        # Multi-GPU: the gradients live in one flat buffer that a step all-reduces once.
        self.grads = (
            distributed.FlatGrads(self.params, self.dist, values=1 + self.READINGS)
            if self.dist.active
            else None
        )
        # The packed step wherever the stack is fused, captured on the GPU; the eager
        # Hugging Face step on the CPU and as the fallback.
        self.eager_reason = self._eager_reason(report)
        captured = self.eager_reason is None
        # micro-batch rows, activation checkpointing, offload (eager step only): the plan for this
        # GPU, or the config's
        self.memory = obey(
            cfg,
            model,
            self.device,
            rows=-(-cfg.batch_size // self.dist.world_size),
            seq=self.train_data.max_seq_len,
            announce=self.callbacks.on_event,
            allow_offload=not captured,
        )
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            fused=self.on_cuda,
            capturable=captured and self.on_cuda,
        )
        # built while lr is a float, so its base_lrs stay floats (checkpoints load anywhere)
        self.scheduler = build_scheduler(
            self.optimizer, total_steps=self.total_steps, warmup_ratio=cfg.warmup_ratio, kind=cfg.lr_scheduler
        )
        self.state = TrainingState(step=0, micro_batches=0, trained_tokens=0, last_train_loss=math.nan)
        if cfg.resume_from is not None:
            ckpt = find_checkpoint(cfg.resume_from)
            self.state = load_checkpoint(
                ckpt, model=model, config=cfg, optimizer=self.optimizer, scheduler=self.scheduler
            )
            self._last_checkpoint_step = self.state.step
            self.callbacks.on_event("info", f"Resumed from checkpoint at step {self.state.step}")
        model.train()
        self.step_fn: CapturedTrainStep | None = None
        if captured:
            self.step_fn = self._captured_step()
            if self.on_cuda:
                self._readback = [torch.empty(2 + self.READINGS, pin_memory=True) for _ in range(2)]
        self._prepare_method()

        n_params = sum(p.numel() for p in self.params)
        self.callbacks.on_event(
            "info",
            f"Model {cfg.model} on {self.device.type} ({str(dtype).removeprefix('torch.')}); "
            f"LoRA r={cfg.lora.r} on {len(layers)} layers, {n_params:,} trainable parameters",
        )
        self.callbacks.on_event(
            "info",
            f"Training data: {self.train_data.examples} examples, {self.train_data.tokens:,} tokens "
            f"({self.train_data.trainable_tokens:,} trainable) in {len(self.train_data)} rows; "
            f"{self.total_steps} steps",
        )
        if self.step_fn is not None:
            shape = self.step_fn.shape
            assert shape is not None
            layout = "packed" if self.train_data.packed else "one example per row"
            self.callbacks.on_event(
                "info",
                f"Training step: fused kernels, CUDA graph; {shape.micro_batches}x{shape.rows} rows of "
                f"{shape.seq} tokens ({layout}), attention confined to each example (variable-length)",
            )
        elif self.on_cuda:
            log.warning("eager training step: %s", self.eager_reason)
            self.callbacks.on_event("warn", f"Training step runs eagerly (slower): {self.eager_reason}")
        self._announce_validation()

    def _check_format(self, fmt: str, label: str) -> None:
        """A supervised run trains on chat, prompt/completion or text lines, never preference pairs."""
        if fmt == PREFERENCE_FORMAT:
            raise ConfigError(
                "method", f"{label} holds preference pairs: train it with method dpo (method.type 'dpo')"
            )

    def _prepare_method(self) -> None:
        """What the method needs once the model, data and step are ready (DPO: its reference)."""

    def _objective(self) -> StepObjective | None:
        """The captured step's objective: None, the cross-entropy of the trained tokens."""
        return None

    def _method_metrics(self, metrics: StepMetrics, readings: list[float], validated: bool) -> None:
        """Add the method's readings to a step's report (the supervised step has none)."""

    def _announce_validation(self) -> None:
        cfg = self.config
        if cfg.validation_file is not None or cfg.validation_split <= 0:
            return
        held = self.valid_data.examples if self.valid_data is not None else 0
        examples = self.train_data.examples + held
        sentence = holdout_sentence(examples=examples, fraction=cfg.validation_split, validation_file=None)
        self.callbacks.on_event("info", sentence)

    def _eager_reason(self, report: FuseReport) -> str | None:
        """Why this run cannot take the packed fused step (None: it can). On the CPU the stack is
        fused only where a test forces the fused modules (with the reference ops)."""
        if not fused_stack(cast(nn.Module, self.model.base_model)):
            if not self.on_cuda:
                return "CPU run"
            skipped = "; ".join(report.skipped[:3]) or "not a fused decoder stack"
            return f"the fused path does not cover model {self.config.model!r} ({skipped})"
        return None

    def _step_shape(self) -> StepShape:
        """Static buffers just big enough for every micro-batch this run will see: B rows (per
        rank) of the data's row length, and the most sequences and trainable tokens that any
        micro-batch's rows hold (the data order is a function of the seed, so this is exact).
        Tight bounds matter: flash attention's backward takes memory per sequence slot, and the
        LM head runs on every trainable-token slot."""
        cfg, data, world = self.config, self.train_data, self.dist.world_size
        rows = -(-cfg.batch_size // world)
        seq = data.max_seq_len  # the rows' length: max_seq_len, or the shorter rows auto planned
        segments = data.rows.segments()  # (rows,): padding continues a row's last sequence
        trainable = data.rows.trainable()  # (rows,)
        work = data.rows.attention_work()  # (rows,): how distributed.shard_rows splits a batch
        most_segments = most_trainable = most_pairs = 1
        for n in range(self.total_micro_batches):
            if n % STOP_CHECK_EVERY == STOP_CHECK_EVERY - 1 and self.callbacks.should_stop():
                raise StopRequested("stopped while sizing the training step")
            epoch, index = divmod(n, self.batches_per_epoch)
            ids = self.sampler.order_ids(epoch)[index * cfg.batch_size : (index + 1) * cfg.batch_size]
            for picked in distributed.balanced_shards(work[ids].tolist(), world):
                shard = ids[picked]
                real = int(segments[shard].sum())
                most_segments = max(most_segments, real + rows - len(shard))
                most_trainable = max(most_trainable, int(trainable[shard].sum()))
                most_pairs = max(most_pairs, real // 2)  # preference rows: two sequences a pair
        loss_tokens = min(rows * seq, -(-most_trainable // 8) * 8)
        pairs = most_pairs if cfg.method.type == "dpo" else 0
        micro = self.memory.micro_rows
        if micro is not None and micro < rows:  # the memory plan's passes of at most `micro` rows
            passes, loss_tokens = -(-rows // micro), min(micro * seq, loss_tokens)
            return StepShape(
                cfg.grad_accum * passes, micro, seq, max(most_segments, micro), loss_tokens, pairs
            )
        return StepShape(cfg.grad_accum, rows, seq, max(most_segments, rows), loss_tokens, pairs)

    def _captured_step(self) -> CapturedTrainStep:
        shape = self._step_shape()
        if self.on_cuda:
            group = self.optimizer.param_groups[0]
            # the graph reads the learning rate from this tensor; _set_lr refills it every step
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)
        dist_ctx = self.dist
        return CapturedTrainStep(
            self.model,
            self.params,
            batch=shape.rows,
            seq=shape.seq,
            lr=self.config.learning_rate,
            max_grad_norm=self.config.max_grad_norm,
            # multi-GPU too: the gradient all_reduce is one NCCL call inside the graph
            capture=self.on_cuda,
            on_fallback=lambda why: self.callbacks.on_event("warn", f"Training step runs eagerly: {why}"),
            shape=shape,
            optimizer=self.optimizer,
            grads=self.grads,
            agree=lambda flag: distributed.any_rank(flag, dist_ctx),
            objective=self._objective(),
        )

    def _base_model(self, dtype: torch.dtype) -> LoadedModel:
        cfg = self.config
        if self._given is None:
            return load_base_model(
                cfg.model,
                store=cfg.model_store,
                device=self.device,
                dtype=dtype,
                quantization=cfg.quantization,
            )
        loaded = self._given
        if loaded.name != cfg.model:
            raise ConfigError(
                "model", f"the preloaded model is {loaded.name!r}, the config asks {cfg.model!r}"
            )
        if loaded.quantization != cfg.quantization:
            raise ConfigError(
                "quantization",
                f"the preloaded model's quantization is {loaded.quantization}, the config asks "
                f"{cfg.quantization}",
            )
        # A crashed earlier job may have left adapters on the cached model: start from the plain base.
        remove_lora(loaded.model)
        first = next(loaded.model.parameters())
        if first.device != self.device or first.dtype != dtype:
            # in place: the cache keeps the move
            cast(nn.Module, loaded.model).to(device=self.device, dtype=dtype)
        return loaded

    @property
    def model(self) -> PreTrainedModel:
        assert self.loaded is not None, "setup() first"
        return self.loaded.model

    # ------------------------------------------------------------------ one step

    def _autocast(self) -> torch.autocast:
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.on_cuda)

    def _loss_sum(self, batch: Batch) -> torch.Tensor:
        """Σ CE over the batch's trainable tokens, fp32 0-d. The head runs only on the positions that
        carry loss: hidden (B, T, H) → selected (N, H) → logits (N, V)."""
        model = self.model
        with self._autocast():
            decoder = cast(nn.Module, model.base_model)
            head = cast(nn.Module, model.get_output_embeddings())
            hidden = decoder(**batch.model_inputs()).last_hidden_state  # (B, T, H)
            targets = batch.labels[:, 1:]  # (B, T-1): label t+1 is predicted at position t
            keep = targets != IGNORE_INDEX
            selected = hidden[:, :-1][keep]  # (N, H)
        # head + CE; on the compiled path chunked and fused (no (N, V) logits), see fused_model
        return lm_loss_sum(selected, head, targets[keep])

    def _train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + backward over the step's micro-batches, then clip. Returns (loss, grad_norm) as
        0-d tensors without a host sync; the optimizer has not stepped yet."""
        n = sum(b.num_trainable_tokens for b in micro_batches)
        total = torch.zeros((), device=self.device)
        if self.grads is not None:
            self.grads.zero_()
        for batch in micro_batches:
            shard = distributed.shard_rows(batch, self.dist)  # the whole batch in one process
            if shard is None:
                continue
            for part in split_rows(shard, self.memory.micro_rows):  # the memory plan's passes
                with offloaded(self.memory.offload, self.device):
                    loss = self._loss_sum(part.to(self.device)) / n
                loss.backward()
                total += loss.detach()
        if self.grads is not None:
            # Multi-GPU: sum the ranks' partial gradients and losses (each divided by the global n).
            total = self.grads.all_reduce_(total)
        grad_norm = gpu_kernels.clip_grad_norm_(self.params, self.config.max_grad_norm)
        return total, grad_norm

    def _eager_step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """The eager step's (2 + READINGS,) values on the device: loss, grad norm (and readings);
        the optimizer has not stepped yet."""
        loss_t, norm_t = self._train_step(micro_batches)
        return torch.stack([loss_t.float(), norm_t.float().to(loss_t.device)])

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        if self.grads is None:  # (the flat buffer is zeroed at the next step's start)
            self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean CE per trainable token over the whole validation set (dropout off)."""
        if self.valid_data is None:
            return None
        sampler = BatchSampler(self.valid_data, self.config.batch_size, self.config.seed, shuffle=False)
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        n = 0
        try:
            for i in range(len(sampler)):
                # Multi-GPU: each rank scores its rows of every batch (all ranks busy, none waiting
                # in a collective); one process: the whole batch.
                batch = distributed.shard_rows(sampler.batch(0, i), self.dist)
                if batch is None:
                    continue
                total += self._loss_sum(batch.to(self.device)).double()
                n += batch.num_trainable_tokens
        finally:
            self.model.train()
        if self.dist.active:  # add up the ranks' loss sums and token counts
            stats = torch.stack([total, torch.tensor(float(n), device=self.device, dtype=torch.float64)])
            distributed.all_reduce_sum(stats, self.dist)
            return float(stats[0].item()) / float(stats[1].item())
        return float(total.item()) / n

    # ------------------------------------------------------------------ loop

    def _step_metrics(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        tokens: int,
        seconds: float,
        valid_loss: float | None = None,
    ) -> StepMetrics:
        """One step's report (eta 0: the caller sets it when the run goes on)."""
        return StepMetrics(
            step=step,
            total_steps=self.total_steps,
            epoch=self.state.micro_batches / self.batches_per_epoch,
            train_loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens=tokens,
            trained_tokens=self.state.trained_tokens,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            step_seconds=seconds,
            eta_seconds=0.0,
            valid_loss=valid_loss,
        )

    def _report(self, findings: list[Finding]) -> None:
        for f in findings:
            self.callbacks.on_event("warn", f.message, f.data())

    def _micro_batches_at(self, start: int) -> list[Batch]:
        """The micro-batches of the optimizer step whose first micro-batch is number `start`."""
        out = []
        for n in range(start, min(start + self.config.grad_accum, self.total_micro_batches)):
            epoch, index = divmod(n, self.batches_per_epoch)
            out.append(self.sampler.batch(epoch, index))
        return out

    def _host_step(self, micro: list[Batch]) -> HostStep:
        """This rank's rows of the step, laid out for the captured step; the loss divides by the
        trainable tokens of the whole step on all ranks."""
        assert self.step_fn is not None and self.step_fn.shape is not None
        host = host_step(self._rank_parts(micro), self.step_fn.shape)
        host.trainable_tokens = sum(b.num_trainable_tokens for b in micro)
        return host

    def _rank_parts(self, micro: list[Batch]) -> list[Batch]:
        """This rank's rows of the step's micro-batches, in the memory plan's passes: what the
        captured step lays out, one part a micro-batch of its shape."""
        shards = [s for s in (distributed.shard_rows(b, self.dist) for b in micro) if s is not None]
        return [part for s in shards for part in split_rows(s, self.memory.micro_rows)]

    def _current_lr(self, steps_ahead: int = 0) -> float:
        """The learning rate of the next step (`steps_ahead` later: of a step queued before the
        schedule moves), on the host (never read back from the device)."""
        epoch = self.scheduler.last_epoch + steps_ahead
        return self.config.learning_rate * self.scheduler.lr_lambdas[0](epoch)

    def _captured_train_step(self, host: HostStep, lr: float) -> torch.Tensor:
        """Queue one captured step; its (2 + READINGS,) fp32 values on the device: loss, grad norm
        (and readings)."""
        assert self.step_fn is not None
        group = self.optimizer.param_groups[0]
        if group["lr"] is not self.step_fn.lr:  # an older LRScheduler assigns a float: undo it
            group["lr"] = self.step_fn.lr
        self.step_fn.set_lr(lr)
        self.step_fn.load_step(host)
        out = self.step_fn.run()
        loss = out["loss"].float().reshape(1)
        parts = [loss, out["grad_norm"].float().reshape(1).to(loss.device)]
        if "readings" in out:
            parts.append(out["readings"].float().to(loss.device))
        return torch.cat(parts)

    def train(self) -> TrainResult:
        cfg = self.config
        state = self.state
        run_start = time.monotonic()
        steps_this_run = 0
        valid_loss: float | None = None
        # the next step's batches, built while the GPU runs the current one
        upcoming: tuple[list[Batch], HostStep | None] | None = None
        # the next captured step, already queued on the GPU behind the current one (run-ahead)
        ahead: _Launched | None = None
        while state.step < self.total_steps:
            stop = self.callbacks.should_stop()
            if stop and ahead is None:
                self.callbacks.on_event("info", f"Stop requested: stopping after step {state.step}")
                path = self.save_checkpoint()
                return self._result(path, valid_loss, stopped=True)
            t0 = time.monotonic()
            epoch_before = state.micro_batches // self.batches_per_epoch
            step = state.step + 1
            lr = self._current_lr()
            if self.step_fn is not None:
                if ahead is not None:
                    launched, ahead = ahead, None
                else:
                    launched = self._launch(*(upcoming or self._prepare(state.micro_batches)), lr, t0)
                micro = launched.micro
                slots = self._slots()
                nxt = state.micro_batches + len(micro)
                upcoming = self._prepare(nxt) if nxt < self.total_micro_batches else None
                if upcoming is not None and not stop and self._may_run_ahead(step, epoch_before, nxt):
                    # Queue the next step before reading this one's loss: the GPU goes on while
                    # the host checks, reports and prepares (a step in flight is never checkpointed).
                    ahead = self._launch(*upcoming, self._current_lr(steps_ahead=1), t0)
                    upcoming = None
                values = self._read(launched)
                step_started = launched.started
            else:
                micro, _ = upcoming or self._prepare(state.micro_batches)
                slots = sum(b.input_ids.numel() for b in micro)
                # the one host read of the step (it waits for the GPU)
                values = self._eager_step(micro).tolist()
                step_started = t0
            loss, grad_norm, readings = values[0], values[1], values[2:]
            tokens = sum(b.num_tokens for b in micro)
            # A diverged run stops with its last checkpoint intact (on the eager path before the
            # optimizer applies the step). The step that blew up is still reported, so the loss
            # curve shows the jump.
            try:
                findings = self.health.check_step(step, loss)
            except DivergedError:
                seconds = time.monotonic() - step_started
                self.callbacks.on_step(self._step_metrics(step, loss, lr, grad_norm, tokens, seconds))
                raise
            if not math.isfinite(grad_norm):
                raise NonFiniteError(step, "gradient norm")
            if self.step_fn is None:
                self._optimizer_step()
            else:  # the graph stepped the optimizer; the schedule moves on the host
                self.scheduler.step()
            state.micro_batches += len(micro)
            epoch_end = state.micro_batches // self.batches_per_epoch > epoch_before
            state.step = step
            state.trained_tokens += tokens
            state.last_train_loss = loss
            steps_this_run += 1

            valid_loss = None
            last = step == self.total_steps
            if self.valid_data is not None and self._eval_due(step, epoch_end):
                valid_loss = self.evaluate()
                if valid_loss is not None:
                    findings += self.health.check_eval(step, valid_loss)
            if last or step == self.total_steps // 2:
                findings += self.health.check_progress(step)
            now = time.monotonic()
            per_step = (now - run_start) / steps_this_run
            metrics = self._step_metrics(step, loss, lr, grad_norm, tokens, now - step_started, valid_loss)
            self._method_metrics(metrics, readings, validated=valid_loss is not None)
            metrics.eta_seconds = per_step * (self.total_steps - step)
            metrics.padding_fraction = 1.0 - tokens / slots if slots else 0.0
            if ahead is not None:  # the queued step's time counts from here (steps tile the run)
                ahead.started = now
            self.callbacks.on_step(metrics)
            self._report(findings)
            if ahead is None:  # with a step in flight, a due checkpoint or limit waits for it
                if not last and self._checkpoint_due(step, epoch_end):
                    self.save_checkpoint()
                self._check_limits(last)

        self.save_checkpoint()
        adapter = cfg.output_dir / ADAPTER_DIR
        if self.dist.is_main:  # the adapters are identical on every rank: one writer
            adapter = export_adapter(adapter, self.model, cfg.lora, cfg.model)
        # Events reach the service's users: name the adapter relative to the run, never a host path.
        self.callbacks.on_event("info", f"Adapter exported to {ADAPTER_DIR}/ (PEFT format)")
        return self._result(adapter, valid_loss, stopped=False)

    def _eval_due(self, step: int, epoch_end: bool) -> bool:
        """Validation loss at every epoch end, every eval_every steps and at the end."""
        every = self.config.eval_every
        return step == self.total_steps or epoch_end or bool(every and step % every == 0)

    def _may_run_ahead(self, step: int, epoch_before: int, micro_after: int) -> bool:
        """May the step after `step` be queued before `step`'s results are read? Only on a GPU
        (where queueing is asynchronous; on the CPU it would just run the next step first), and
        where nothing between the two needs the weights of `step` alone: no checkpoint,
        validation or limit is due. Callbacks then see step N's report while step N + 1 runs:
        they must not read the model. Ranks decide together (one host exchange, made while the
        GPUs run step N): the time-based checkpoint and wall-clock limit differ between ranks,
        and every rank must queue the same collectives."""
        if not self.on_cuda or step >= self.total_steps:
            return False
        epoch_end = micro_after // self.batches_per_epoch > epoch_before
        due = bool(
            (self.valid_data is not None and self._eval_due(step, epoch_end))
            or self._checkpoint_due(step, epoch_end)
            or self._limit_reason() is not None
        )
        return not distributed.any_rank(due, self.dist)

    def _launch(self, micro: list[Batch], host: HostStep | None, lr: float, started: float) -> _Launched:
        """Queue one captured step on the GPU and its (loss, grad norm) read-back; nothing waits."""
        assert host is not None
        values = self._captured_train_step(host, lr)  # (2 + READINGS,) fp32
        if values.device.type != "cuda":
            return _Launched(micro, started, values, None)
        # two pinned buffers in turn: a queued step's copy never overwrites the unread one
        self._launches += 1
        host_values = self._readback[self._launches % 2]
        host_values.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _Launched(micro, started, host_values, done)

    @staticmethod
    def _read(launched: _Launched) -> list[float]:
        """The step's loss and gradient norm (and readings), waiting for that step only (not one
        queued after)."""
        if launched.done is not None:
            launched.done.synchronize()
        values: list[float] = launched.values.tolist()
        return values

    def _prepare(self, start: int) -> tuple[list[Batch], HostStep | None]:
        micro = self._micro_batches_at(start)
        return micro, (self._host_step(micro) if self.step_fn is not None else None)

    def _slots(self) -> int:
        """Token slots one captured step computes on (real or padding), all ranks."""
        assert self.step_fn is not None and self.step_fn.shape is not None
        return self.step_fn.shape.slots * self.dist.world_size

    def _checkpoint_due(self, step: int, epoch_end: bool) -> bool:
        """Every `checkpoint_every` steps, at an epoch end, or once `checkpoint_interval_seconds`
        of training passed since the last checkpoint: a lost worker loses at most that much."""
        cfg = self.config
        interval = cfg.checkpoint_interval_seconds
        return bool(
            (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            or (cfg.checkpoint_each_epoch and epoch_end)
            or (interval > 0 and time.monotonic() - self._last_checkpoint_time >= interval)
        )

    def _limit_reason(self) -> str | None:
        """Why the run must stop now (max_tokens or max_wall_seconds exceeded), or None."""
        cfg, state = self.config, self.state
        reason = None
        if cfg.max_tokens is not None and state.trained_tokens > cfg.max_tokens:
            reason = f"max_tokens {cfg.max_tokens} exceeded: {state.trained_tokens} tokens trained"
        elapsed = time.monotonic() - self.started
        if cfg.max_wall_seconds is not None and elapsed > cfg.max_wall_seconds:
            reason = f"max_wall_seconds {cfg.max_wall_seconds:g} exceeded: ran {elapsed:.1f} s"
        return reason

    def _check_limits(self, last: bool) -> None:
        state = self.state
        reason = self._limit_reason()
        # Every rank must leave the loop together (wall time differs slightly between ranks).
        exceeded = distributed.any_rank(reason is not None, self.dist)
        if not exceeded or last:
            return
        reason = reason or "a limit was exceeded on another rank"
        self.save_checkpoint()
        raise LimitExceeded(f"{reason} at step {state.step}; checkpoint kept")

    def _result(self, adapter_dir: Path, valid_loss: float | None, *, stopped: bool) -> TrainResult:
        return TrainResult(
            adapter_dir=adapter_dir,
            steps=self.state.step,
            trained_tokens=self.state.trained_tokens,
            final_train_loss=self.state.last_train_loss,
            final_valid_loss=valid_loss,
            checkpoints=list(self.checkpoints),
            stopped=stopped,
        )

    # ------------------------------------------------------------------ checkpoints, cleanup

    def save_checkpoint(self) -> Path:
        """Write (or, if this step is already saved, reuse) the checkpoint of the current step."""
        path = checkpoint_dir(self.config.output_dir, self.state.step)
        if not self.dist.is_main:  # rank 0 writes the (identical) adapters and optimizer state
            return path
        if self._last_checkpoint_step == self.state.step and path.is_dir():
            return path
        path = save_checkpoint(
            output_dir=self.config.output_dir,
            model=self.model,
            config=self.config,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=self.state,
            batches_per_epoch=self.batches_per_epoch,
        )
        self._last_checkpoint_step = self.state.step
        self._last_checkpoint_time = time.monotonic()
        info = CheckpointInfo(step=self.state.step, path=path, samples=self.sample_eval_prompts())
        self.checkpoints.append(info)
        self.callbacks.on_checkpoint(info)
        return path

    def sample_eval_prompts(self) -> list[str]:
        """Greedy answers of the model as it is now to `eval_prompts` (single-turn user chats).
        Runs on the unwrapped model of rank 0 only: no collective is involved."""
        if not self.config.eval_prompts:
            return []
        assert self.loaded is not None
        return greedy_samples(self.model, self.loaded.tokenizer, self.config.eval_prompts, self.device)

    def cleanup(self) -> None:
        """Remove the adapters so a cached base model is pristine for the next job; free the rest.
        The step's CUDA graph goes first: one that captured NCCL collectives would otherwise make
        the process group's teardown wait forever."""
        step_fn: CapturedTrainStep | None = self.__dict__.get("step_fn")
        if step_fn is not None:
            step_fn.release()
        if self.loaded is not None:
            remove_checkpointing(self.loaded.model)
        if self.loaded is not None and lora_modules(self.loaded.model):
            remove_lora(self.loaded.model)
            self.loaded.model.eval()
        for name in (
            "step_fn",
            "grads",
            "optimizer",
            "scheduler",
            "params",
            "train_data",
            "valid_data",
            "sampler",
        ):
            self.__dict__.pop(name, None)
        if self._given is None:
            self.loaded = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        distributed.shutdown(self.dist)


def train(
    config: TrainConfig, callbacks: TrainingCallbacks, *, loaded: LoadedModel | None = None
) -> TrainResult:
    """Run one fine-tune; `loaded` lets a worker reuse a base model it keeps between jobs. The
    method picks the recipe: supervised (this module) or DPO (worker/engine/dpo.py)."""
    recipe_class = LoRAFinetuneRecipe
    if config.method.type == "dpo":
        from worker.engine.dpo import DpoRecipe  # it builds on this module

        recipe_class = DpoRecipe
    recipe = recipe_class(config, callbacks, loaded=loaded)
    try:
        try:
            recipe.setup()
        except StopRequested as stop:  # asked to stop before the first step: nothing to save
            recipe.callbacks.on_event("info", f"Stop requested: {stop}")
            return TrainResult(config.output_dir, 0, 0, math.nan, None, [], stopped=True)
        return recipe.train()
    finally:
        recipe.cleanup()
