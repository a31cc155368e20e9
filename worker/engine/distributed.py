"""Multi-GPU training on one host: data parallelism over the LoRA adapters (torchrun, one rank per GPU).

Math. Every rank loads the same frozen base model (replicated, never communicated) and draws the
same seeded LoRA init. Every rank builds the same one-process batches; of each micro-batch
(B, T), rank r trains on as many rows as the DistributedSampler split r, r+W, r+2W, ... would give
it (W = world size), chosen so that the ranks' attention work is even (`balanced_shards`): data
order and step count are exactly a one-process run's, and a step waits less for its slowest rank.
The recipe divides each rank's summed token loss by the step's *global* trainable-token count N
(every rank knows N: it sees whole batches), so summing adapter gradients over ranks with one flat
all_reduce gives the one-process gradient of the combined batch (up to float summation order):

    g = Σ_r ∇ Σ_{t ∈ shard_r} CE_t / N = ∇ Σ_t CE_t / N

The adapters' gradients live in one flat fp32 buffer (`FlatGrads`: every `p.grad` is a view of
it, the backward accumulates into it in place) with one more slot for the step's loss, so a step
communicates once: one all_reduce of a buffer whose address and size never change, which a CUDA
graph can capture (NCCL >= 2.9.6; PyTorch's NCCL group skips its watchdog bookkeeping while a
stream is capturing). Host-side agreements (a stop request, a limit, a capture that failed on
one rank) go over a gloo group on the CPU, so they never wait for the GPU.

fp32 equality. Per step the two-rank gradient equals the one-process gradient to fp32 rounding
(~2e-7 relative: the weight-gradient GEMMs sum the rows in another order), packed or not. Over
several steps AdamW amplifies that rounding where a gradient element is below its eps (1e-8):
its update is lr·g/(|g| + eps), so absolute noise there is scaled by up to lr/eps. Measured on
tiny-llama, packed, lr 1e-2: 3 steps leave the adapters 5.6e-6 apart (relative L2) with gloo
and exactly the same 5.6e-6 in ONE process summing the two shards' gradients instead of the
whole batch's (no communication at all); with eps 1e-4 it is 5e-8. The tests therefore compare
gradients and losses from the same state (tests/deploy/test_distributed.py).

Clipping and AdamW then run on identical gradients on every rank, so the adapters stay identical
without broadcasting weights. Only rank 0 reports (metrics, events, checkpoints, the exported
adapter): the job has one loss curve. `should_stop()` and the limit checks are agreed by all ranks
so that no rank leaves the loop while another waits in a collective.

With WORLD_SIZE unset or 1 every helper here is a no-op, so one-process training is unchanged.

Process boundary. The worker (worker/runner.py, in the Celery process) calls `run_torchrun`, which
starts `torchrun -m worker.engine.distributed CONFIG WORKDIR` and turns the JSON lines that rank 0
writes to WORKDIR/events.jsonl back into calls on the job's callbacks; a stop request becomes the
file WORKDIR/stop, which rank 0 sees in `should_stop()`. The engine process never touches the
database.

Several hosts (a job's `n_nodes` > 1): each host's worker calls `run_node` with the attempt's
`Rendezvous` (torchrun's c10d rendezvous, served by the first host's torchrun); ranks are numbered
across hosts, the math above is unchanged with W = n_nodes × n_gpus, and the worker on the host
that got global rank 0 is the one that reads events.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import TypeAdapter

import gpu_kernels
from worker.engine import types as engine_types
from worker.engine.data import Batch
from worker.engine.memory_plan import MemoryChoice
from worker.engine.training_config import TrainingMethod
from worker.engine.types import (
    CheckpointInfo,
    EngineError,
    LoraConfig,
    NodeFailed,
    Rendezvous,
    StepMetrics,
    TrainConfig,
    TrainingCallbacks,
    TrainResult,
)

EVENTS_FILE = "events.jsonl"
STOP_FILE = "stop"
# Touched by every rank as it starts: torchrun starts ranks only once the rendezvous is complete,
# so without it the hosts of a job on several are still gathering and no rank reads STOP_FILE.
STARTED_FILE = "started"
# Touched by every rank whose training returned (`finished-<local rank>`). A host's torchrun can
# exit 0 with its ranks stopped mid-job: seen when another host was lost (most likely its agent
# outlived its rank for a moment and closed the rendezvous, and torchrun's agent exits 0 on a
# closed rendezvous); nothing else says so.
FINISHED_PREFIX = "finished-"
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this process initialised the group, so it destroys it
    # gloo group for host-side agreement (CPU tensors: no GPU sync); None = the default group
    control: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


SINGLE = DistContext()


def init_from_env(device: torch.device) -> tuple[DistContext, torch.device]:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT).

    Returns the context and the device this rank trains on (cuda:LOCAL_RANK under CUDA). NCCL on
    CUDA, gloo on CPU (the CI path).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE, device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return DistContext(rank, world, local_rank, owns, control), device


def shutdown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def row_attention_work(batch: Batch) -> torch.Tensor:
    """(B,) int64: the query-key pairs causal attention computes over each row's real tokens,
    Σ_t (position_t + 1) = Σ over the row's sequences of L(L+1)/2 (`Rows.attention_work` counts the
    same from the dataset). Packed rows of one batch have the same width, so their GEMM and norm
    work is equal; what differs is this: one 1,900-token conversation against a dozen short ones."""
    return ((batch.position_ids + 1) * batch.attention_mask).sum(dim=1)


def balanced_shards(work: Sequence[int], world: int) -> list[list[int]]:
    """Each rank's rows of a batch whose rows have `work` (B,): rank r gets as many rows as the
    strided split r, r+W, ... would give it (what the captured step's static shape is sized for;
    none where B < W and r >= B), picked longest-first onto the rank with the least work so far
    (ties: the lower rank, then the lower row), so that a multi-GPU step waits less for its
    slowest rank; the strided split itself where the greedy one is no better (greedy is a
    heuristic: now and then it is worse, and with one row a rank nothing can be balanced). A pure
    function of `work`: every rank computes the same split. Within a rank, rows keep the batch's
    order."""
    n = len(work)
    strided = [list(range(r, n, world)) for r in range(world)]
    load = [0] * world
    greedy: list[list[int]] = [[] for _ in range(world)]
    for row in sorted(range(n), key=lambda i: (-work[i], i)):
        rank = min((load[r], r) for r in range(world) if len(greedy[r]) < len(strided[r]))[1]
        greedy[rank].append(row)
        load[rank] += work[row]

    def slowest(shards: list[list[int]]) -> int:
        return max(sum(work[i] for i in rows) for rows in shards)

    return strided if slowest(strided) <= slowest(greedy) else [sorted(s) for s in greedy]


def shard_rows(batch: Batch, ctx: DistContext) -> Batch | None:
    """This rank's rows of a batch (every tensor (B, T)), as `balanced_shards` splits them; None
    if it has none (fewer rows than ranks: it adds zero gradient this micro-batch)."""
    if not ctx.active:
        return batch
    mine = balanced_shards(row_attention_work(batch).tolist(), ctx.world_size)[ctx.rank]
    if not mine:
        return None
    rows = torch.tensor(mine, dtype=torch.int64)
    b = batch
    row_ids = b.row_ids[rows] if b.row_ids is not None else None
    return Batch(
        b.input_ids[rows], b.labels[rows], b.attention_mask[rows], b.position_ids[rows], b.packed, row_ids
    )


class FlatGrads:
    """The adapters' gradients as views of one flat fp32 buffer (Σ numel + 1,), the last slot for
    the step's loss: zero it before the backward, `all_reduce_` after it.

    The backward accumulates into the views in place (AccumulateGrad adds into a defined .grad),
    so no copy is made before or after the collective, and the buffer's address never changes
    (what a captured graph needs). A rank without rows in a micro-batch simply adds nothing.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], ctx: DistContext, values: int = 1) -> None:
        """`values`: slots after the gradients summed with them (the loss; DPO: and its readings)."""
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("FlatGrads holds fp32 gradients: the adapters must be fp32")
        self.params = list(params)
        self.ctx = ctx
        n = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(n + values, dtype=torch.float32, device=self.params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        # () view (or (values,)): the summed loss after all_reduce_
        self.loss = self.flat[n] if values == 1 else self.flat[n:]
        self._attach()

    def _attach(self) -> None:
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is not view:
                p.grad = view

    def zero_(self) -> None:
        """Zero every gradient and the loss slot (re-pointing any .grad something replaced)."""
        self._attach()
        self.flat.zero_()

    def all_reduce_(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum gradients and `loss` (0-d) over the ranks in one collective; returns the summed loss
        (a view of the buffer, valid until the next zero_)."""
        self.loss.copy_(loss.detach().reshape(self.loss.shape))
        if self.ctx.active:
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
        return self.loss


def all_reduce_sum(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.active:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when `flag` is true on at least one. Over the control (gloo) group with a
    CPU tensor: a host exchange that never waits for the GPU."""
    if not ctx.active:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.control)
    return bool(t.item() > 0)


class RankZeroCallbacks:
    """Forward reports from rank 0 only; `should_stop()` is rank 0's answer, shared with all ranks."""

    def __init__(self, inner: TrainingCallbacks, ctx: DistContext) -> None:
        self.inner, self.ctx = inner, ctx

    def on_step(self, metrics: StepMetrics) -> None:
        if self.ctx.is_main:
            self.inner.on_step(metrics)

    def on_event(
        self, level: Literal["info", "warn", "error"], message: str, data: dict[str, Any] | None = None
    ) -> None:
        if self.ctx.is_main:
            self.inner.on_event(level, message, data)

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        if self.ctx.is_main:
            self.inner.on_checkpoint(checkpoint)

    def should_stop(self) -> bool:
        return any_rank(self.ctx.is_main and self.inner.should_stop(), self.ctx)


def wrap_callbacks(inner: TrainingCallbacks, ctx: DistContext) -> TrainingCallbacks:
    return RankZeroCallbacks(inner, ctx) if ctx.active else inner


# --------------------------------------------------------------------------- the torchrun side


class FileCallbacks:
    """Rank 0's callbacks inside torchrun: one JSON object per line to events.jsonl; stop = a file."""

    def __init__(self, workdir: Path) -> None:
        self.events = workdir / EVENTS_FILE
        self.stop_file = workdir / STOP_FILE

    def _write(self, record: dict[str, Any]) -> None:
        with self.events.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def on_step(self, metrics: StepMetrics) -> None:
        self._write({"type": "step", **dataclasses.asdict(metrics)})

    def on_event(
        self, level: Literal["info", "warn", "error"], message: str, data: dict[str, Any] | None = None
    ) -> None:
        self._write({"type": "event", "level": level, "message": message, "data": data})

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        self._write(
            {
                "type": "checkpoint",
                "step": checkpoint.step,
                "path": str(checkpoint.path),
                "samples": checkpoint.samples,
            }
        )

    def should_stop(self) -> bool:
        return self.stop_file.exists()

    def result(self, result: TrainResult) -> None:
        self._write({"type": "result", **dataclasses.asdict(result)})

    def error(self, exc: BaseException) -> None:
        code = exc.code if isinstance(exc, EngineError) else "internal_error"
        param = exc.param if isinstance(exc, EngineError) else None
        self._write({"type": "error", "code": code, "param": param, "message": str(exc)})


def config_to_json(config: TrainConfig) -> str:
    return json.dumps(config.to_dict())


_METHOD: TypeAdapter[TrainingMethod] = TypeAdapter(TrainingMethod)


def config_from_json(text: str) -> TrainConfig:
    d = json.loads(text)
    d["lora"] = LoraConfig(**d["lora"])
    d["method"] = _METHOD.validate_python(d["method"])  # supervised or dpo, typed again
    d["auto"] = tuple(d["auto"])
    if d.get("memory") is not None:
        d["memory"] = MemoryChoice(**d["memory"])
    for key in ("train_file", "output_dir", "model_store", "validation_file", "resume_from"):
        if d.get(key) is not None:
            d[key] = Path(d[key])
    return TrainConfig(**d)


def kernel_args(kernels: gpu_kernels.KernelConfig) -> list[str]:
    """The worker's kernel switches as the ranks' arguments (gpu_kernels reads no environment)."""
    args = ["--kernels", kernels.backend, "--rank-update", kernels.rank_update]
    return args if kernels.cache_dir is None else [*args, "--kernel-cache", str(kernels.cache_dir)]


def main(argv: list[str] | None = None) -> int:
    """Entry point of every torchrun rank:
    `python -m worker.engine.distributed CONFIG_JSON WORKDIR [--kernels ... --rank-update ...]`."""
    from worker.engine import recipe

    parser = argparse.ArgumentParser(prog="worker.engine.distributed")
    parser.add_argument("config_path", type=Path)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--rank-update", default="epilogue")
    parser.add_argument("--kernel-cache", type=Path)
    args = parser.parse_args(argv)
    gpu_kernels.configure(gpu_kernels.KernelConfig(args.kernels, args.rank_update, args.kernel_cache))
    workdir = args.workdir
    config = config_from_json(args.config_path.read_text())
    (workdir / STARTED_FILE).touch()
    is_main = int(os.environ.get("RANK", "0")) == 0
    reporter = FileCallbacks(workdir)
    try:
        result = recipe.train(config, reporter if is_main else engine_types.NullCallbacks())
    except BaseException as exc:
        if is_main:
            reporter.error(exc)
        raise
    if is_main:
        reporter.result(result)
    (workdir / f"{FINISHED_PREFIX}{os.environ.get('LOCAL_RANK', '0')}").touch()
    return 0


# --------------------------------------------------------------------------- the worker side


class DistributedRunError(EngineError):
    code = "distributed_run_failed"


def _rank_zero_error(record: dict[str, Any]) -> Exception:
    """Rebuild rank 0's error. An engine error keeps its code, param and message (the job fails
    with them, as in one process); anything else stays an internal error, which the worker reports
    generically and logs."""
    if record["code"] == "internal_error":
        return RuntimeError(f"rank 0 of the torchrun job failed: {record['message']}")
    err = DistributedRunError(record["message"])
    err.code = record["code"]
    err.param = record.get("param")
    return err


def torchrun_argv(
    config_path: Path, workdir: Path, n_gpus: int, rendezvous: Rendezvous | None = None
) -> list[str]:
    """The ranks run with this process's kernel switches (`gpu_kernels.current_config()`)."""
    where = ["--standalone"] if rendezvous is None else rendezvous.torchrun_args()
    return [
        sys.executable, "-m", "torch.distributed.run",
        *where, f"--nproc-per-node={n_gpus}",
        "-m", "worker.engine.distributed", str(config_path), str(workdir),
        *kernel_args(gpu_kernels.current_config()),
    ]  # fmt: skip


def run_torchrun(
    config: TrainConfig, callbacks: TrainingCallbacks, *, n_gpus: int, workdir: Path
) -> TrainResult:
    """Run `config` on `n_gpus` ranks of this host; forward rank 0's reports to `callbacks`.

    Blocks until torchrun exits. Raises the engine error rank 0 reported (same code and message as
    in one process), or RuntimeError when a rank crashed or was killed without one.
    """
    returncode, records, tail = _launch(config, callbacks, n_gpus=n_gpus, workdir=workdir, rendezvous=None)
    return _outcome(returncode, records, tail)


def run_node(
    config: TrainConfig, callbacks: TrainingCallbacks, *, n_gpus: int, workdir: Path, rendezvous: Rendezvous
) -> TrainResult | None:
    """This host's `n_gpus` ranks of a job on `rendezvous.n_nodes` hosts; forward the reports of
    global rank 0 to `callbacks` when it is here.

    As `run_torchrun`, but None when the ranks here finished and rank 0 was on another host (that
    host's worker reports), and `NodeFailed` when a rank of any host failed without an engine error.
    """
    returncode, records, tail = _launch(
        config, callbacks, n_gpus=n_gpus, workdir=workdir, rendezvous=rendezvous
    )
    ends = [r for r in records if r["type"] in ("result", "error")]
    unfinished = n_gpus - len(list(workdir.glob(f"{FINISHED_PREFIX}*")))
    node_failure(rendezvous, returncode, ends[-1] if ends else None, tail, unfinished)
    if returncode == 0 and not records:
        return None  # rank 0 was on another host
    return _outcome(returncode, records, tail)


def _launch(
    config: TrainConfig,
    callbacks: TrainingCallbacks,
    *,
    n_gpus: int,
    workdir: Path,
    rendezvous: Rendezvous | None,
) -> tuple[int, list[dict[str, Any]], str]:
    """Run torchrun to its end, forwarding rank 0's records as they come: (exit code, records, the
    tail of its log)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < n_gpus:
        # A misrouted job (or a worker started without --gpus-per-job): say so instead of a rank crash.
        err = DistributedRunError(
            f"n_gpus is {n_gpus} but this worker sees {torch.cuda.device_count()} GPU(s); start it with "
            f"`loraq worker --gpus ... --gpus-per-job {n_gpus}`"
        )
        err.param = "n_gpus"
        raise err
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / EVENTS_FILE
    events.unlink(missing_ok=True)
    (workdir / STOP_FILE).unlink(missing_ok=True)
    (workdir / STARTED_FILE).unlink(missing_ok=True)
    for marker in workdir.glob(f"{FINISHED_PREFIX}*"):
        marker.unlink()
    config_path = workdir / "config.json"
    config_path.write_text(config_to_json(config))
    log_path = workdir / "torchrun.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            torchrun_argv(config_path, workdir, n_gpus, rendezvous), stdout=log, stderr=subprocess.STDOUT
        )
        records: list[dict[str, Any]] = []
        offset = 0
        try:
            while True:
                finished = proc.poll() is not None
                offset = _forward(events, offset, callbacks, records)
                if finished:
                    break
                if callbacks.should_stop():
                    (workdir / STOP_FILE).touch()
                    if rendezvous is not None and not (workdir / STARTED_FILE).exists():
                        proc.terminate()  # still gathering hosts: stop waiting (NodeFailed follows)
                time.sleep(POLL_SECONDS)
        finally:
            if proc.poll() is None:  # the worker itself is stopping: take torchrun's ranks with it
                proc.terminate()
                proc.wait()
    return proc.returncode, records, log_path.read_text(errors="replace")[-2000:]


def _outcome(returncode: int, records: list[dict[str, Any]], tail: str) -> TrainResult:
    """Rank 0's result, or the error it reported, or RuntimeError with the log's tail."""
    ends = [r for r in records if r["type"] in ("result", "error")]
    if ends and ends[-1]["type"] == "result" and returncode == 0:
        r = ends[-1]
        return TrainResult(
            adapter_dir=Path(r["adapter_dir"]),
            steps=r["steps"],
            trained_tokens=r["trained_tokens"],
            final_train_loss=r["final_train_loss"],
            final_valid_loss=r["final_valid_loss"],
            checkpoints=[CheckpointInfo(c["step"], Path(c["path"])) for c in r["checkpoints"]],
            stopped=r["stopped"],
        )
    if ends and ends[-1]["type"] == "error":
        raise _rank_zero_error(ends[-1])
    raise RuntimeError(f"torchrun exited with code {returncode} and no result; log tail:\n{tail}")


def node_failure(
    rendezvous: Rendezvous, returncode: int, end: dict[str, Any] | None, tail: str, unfinished: int
) -> None:
    """Raise `NodeFailed` when this host's torchrun of a job on several hosts ended without a
    result or an engine error of rank 0's (those fail the job as in one process): a rendezvous
    that timed out, a peer host that died, any crash, or an exit 0 with `unfinished` of this
    host's ranks not through their training (the rendezvous closed under them: FINISHED_PREFIX).
    Returns when there is nothing to raise."""
    if returncode == 0 and unfinished <= 0:
        return
    if end is not None and end["type"] == "error" and end["code"] != "internal_error":
        return
    n = rendezvous.n_nodes
    if returncode == 0:
        where = f"the rendezvous at {rendezvous.endpoint}"
        seen = f"{where} closed before {unfinished} of this host's ranks finished"
        raise NodeFailed(f"a host of the job's {n} failed ({seen})", log_tail=tail)
    if "RendezvousTimeoutError" in tail:
        raise NodeFailed(f"not all {n} hosts joined within {rendezvous.join_timeout_s:g} s", log_tail=tail)
    if "RendezvousConnectionError" in tail and not rendezvous.is_host:
        # this host's agent lost the store: the first host (the one that claimed the job) is gone
        seen = f"the first host, serving the rendezvous at {rendezvous.endpoint}, was lost"
    elif end is not None and end["message"].strip():
        seen = end["message"].strip().splitlines()[-1]  # rank 0's own error, e.g. gloo's lost peer
    else:
        seen = f"torchrun exited with code {returncode}"
    raise NodeFailed(f"a host of the job's {n} failed ({seen})", log_tail=tail)


def _forward(events: Path, offset: int, callbacks: TrainingCallbacks, records: list[dict[str, Any]]) -> int:
    """Dispatch the complete lines written since `offset`; return the new offset."""
    if not events.exists():
        return offset
    with events.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]
    for line in complete.splitlines():
        record = json.loads(line)
        records.append(record)
        kind = record.pop("type")
        if kind == "step":
            callbacks.on_step(StepMetrics.from_record(record))
        elif kind == "event":
            callbacks.on_event(record["level"], record["message"], record.get("data"))
        elif kind == "checkpoint":
            callbacks.on_checkpoint(
                CheckpointInfo(record["step"], Path(record["path"]), record.get("samples", []))
            )
        record["type"] = kind
    return offset + len(complete)


if __name__ == "__main__":
    sys.exit(main())
