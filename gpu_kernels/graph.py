"""CUDA-graph capture of a whole training step, with fallback to eager.

`GraphedStep(step_fn)` wraps a function that runs ONE training step (zero grads, forward,
backward, clip, optimizer step) reading its inputs from static buffers that the caller refills
before each call, and returns a dict of output tensors (loss, grad norm, ...). Calling it runs
one step:

  calls 1..warmup   eager, on a side stream (what capture needs: the optimizer state, cuBLAS
                    workspaces and autograd's buffers exist before capture)
  call warmup+1     capture the step into a graph, then replay it once (that is this step)
  later calls       replay: one launch for the whole step, the returned tensors are the static
                    outputs, overwritten by each replay

If capture raises (an op that syncs, a CPU tensor, dynamic shapes...), the graph is dropped and
every later call runs eagerly; `fallback_reason` says why and `on_fallback` is told once.
With several processes running one step together (multi-GPU, a collective inside the step),
`agree(flag)` returns whether any process raised `flag`: a capture that failed anywhere, or a
graph measured slower anywhere, sends every process to the eager step at the same call.
With `keep_faster` (default), the last eager warm-up step and the first replays are timed with
CUDA events (a few host syncs at start-up only); if the replay is slower by more than
`GRAPH_MARGIN`, the graph is dropped the same way. A graph is not always faster: measured on an
H100, cuDNN's fused attention ran about 2.5x slower inside a captured graph than eagerly. Within
the margin the graph stays: the two are equal within timing noise, and the graph has no
per-kernel host work and a fixed memory pool (llama-8b's job step, 241.75 ms eager vs 241.91 ms
replayed, went eager on a coin toss and took 100 MB more at its peak).
Requirements on step_fn: fixed shapes; no host reads of device values (no .item()); the
optimizer must be capturable (`torch.optim.AdamW(..., fused=True, capturable=True)`, lr as a
tensor to change it between replays); gradients set to None at the start of the step, so the
backward allocates them in the graph's memory pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

# A replay this much slower than the eager step (relative) sends the step to eager mode.
GRAPH_MARGIN = 0.03


def graph_is_slower(replay_ms: float, eager_ms: float) -> bool:
    """Is the replayed graph measurably slower than the eager step (beyond GRAPH_MARGIN)?"""
    return replay_ms > eager_ms * (1.0 + GRAPH_MARGIN)


log = logging.getLogger(__name__)

StepOutputs = dict[str, torch.Tensor]


class GraphedStep:
    def __init__(
        self,
        step_fn: Callable[[], StepOutputs],
        *,
        warmup: int = 3,
        enabled: bool = True,
        keep_faster: bool = True,
        on_fallback: Callable[[str], None] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        if warmup < 1:
            raise ValueError("warmup must be at least 1 (capture needs one eager step first)")
        self.step_fn = step_fn
        self.warmup = warmup
        self.on_fallback = on_fallback
        self.agree = agree or (lambda flag: flag)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_outputs: StepOutputs | None = None
        self.fallback_reason: str | None = None if enabled else "graph capture disabled"
        self.calls = 0
        self.keep_faster = keep_faster
        self.eager_ms: float | None = None  # last timed eager warm-up step
        self.replay_ms: list[float] = []  # first timed replays
        self._side_stream: torch.cuda.Stream | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        self.graph = None
        self.static_outputs = None
        log.warning("training step runs eagerly: %s", reason)
        if self.on_fallback is not None:
            self.on_fallback(reason)

    def __call__(self) -> StepOutputs:
        self.calls += 1
        if self.fallback_reason is not None:
            return self.step_fn()
        if not torch.cuda.is_available():
            self._fall_back("no CUDA device")
            return self.step_fn()
        if self.graph is not None:
            if self.keep_faster and len(self.replay_ms) < 2:
                return self._timed_replay()
            self.graph.replay()
            assert self.static_outputs is not None
            return self.static_outputs
        if self.calls <= self.warmup:
            timed = self.keep_faster and self.calls == self.warmup and self.warmup > 1
            return self._eager_on_side_stream(timed)
        return self._capture_and_replay()

    def release(self) -> None:
        """Free the graph now; later calls run the step eagerly. A process that captured NCCL
        collectives must do this before it destroys its process group: NCCL's teardown waits for
        every graph that holds its kernels, so destroy_process_group() would hang
        (pytorch/pytorch#115388). The graph's step function usually closes over this object, so
        waiting for the garbage collector is no answer."""
        if self.graph is not None:
            if torch.cuda.is_available():  # a replay still in flight ends before its pool is freed
                torch.cuda.synchronize()
            self.graph.reset()
        self.graph = None
        self.static_outputs = None
        if self.fallback_reason is None:
            self.fallback_reason = "graph released"

    def _timed_replay(self) -> StepOutputs:
        assert self.graph is not None and self.static_outputs is not None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        end.synchronize()
        self.replay_ms.append(start.elapsed_time(end))
        outputs = self.static_outputs
        if len(self.replay_ms) == 2 and self.eager_ms is not None:
            replay = min(self.replay_ms)
            if self.agree(graph_is_slower(replay, self.eager_ms)):
                # this call's step already ran (replayed); later calls run eagerly
                self._fall_back(
                    f"eager step measured faster than its graph ({self.eager_ms:.2f} ms vs {replay:.2f} ms)"
                )
                return {k: v.clone() for k, v in outputs.items()}
        return outputs

    def _eager_on_side_stream(self, timed: bool = False) -> StepOutputs:
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._side_stream.wait_stream(current)
        with torch.cuda.stream(self._side_stream):
            if timed:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            out = self.step_fn()
            if timed:
                end.record()
                end.synchronize()
                self.eager_ms = start.elapsed_time(end)
        current.wait_stream(self._side_stream)
        return out

    def _capture_and_replay(self) -> StepOutputs:
        # once, before capture: the eager warm-up's work (its collectives too, which a watchdog
        # thread may still be polling) has finished, so nothing outside the capture is in flight
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        failure: str | None = None
        try:
            with torch.cuda.graph(graph):
                outputs = self.step_fn()
        except Exception as exc:  # capture refuses many things; each one means: run eagerly
            failure = f"CUDA graph capture failed: {type(exc).__name__}: {exc}"[:2000]
        if self.agree(failure is not None):
            self._fall_back(failure or "CUDA graph capture failed on another process")
            # capture executed nothing: this call's step still has to run
            return self.step_fn()
        self.graph = graph
        self.static_outputs = outputs
        graph.replay()
        return outputs
