"""GraphedStep and the non-finite monitor, on the paths a machine without a GPU takes."""

from __future__ import annotations

import pytest
import torch

import gpu_kernels
from gpu_kernels import reference


def test_warmup_must_allow_one_eager_step() -> None:
    with pytest.raises(ValueError, match="warmup"):
        gpu_kernels.GraphedStep(lambda: {}, warmup=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_without_cuda_every_call_runs_eagerly_and_the_reason_is_told_once() -> None:
    calls: list[int] = []
    reasons: list[str] = []

    def step() -> dict[str, torch.Tensor]:
        calls.append(1)
        return {"loss": torch.tensor(float(len(calls)))}

    graphed = gpu_kernels.GraphedStep(step, warmup=1, on_fallback=reasons.append)
    outs = [graphed()["loss"].item() for _ in range(3)]
    assert outs == [1.0, 2.0, 3.0]
    assert reasons == ["no CUDA device"] and not graphed.captured


def test_disabled_capture_runs_eagerly_with_a_reason() -> None:
    graphed = gpu_kernels.GraphedStep(lambda: {"x": torch.zeros(())}, enabled=False)
    graphed()
    assert graphed.fallback_reason == "graph capture disabled"


def test_monitor_reads_the_device_flag_only_when_due() -> None:
    monitor = gpu_kernels.NonFiniteMonitor("cpu", every=3)
    p = torch.nn.Parameter(torch.zeros(2))
    seen = []
    for step in range(1, 7):
        p.grad = torch.tensor([float("nan") if step == 2 else 1.0, 0.0])
        reference.clip_grad_norm_([p], 1.0, monitor.state)
        seen.append(monitor.check(step))
    assert seen == [None, None, 2, None, None, 2]
    assert monitor.check(1, force=True) == 2
    with pytest.raises(ValueError):
        gpu_kernels.NonFiniteMonitor("cpu", every=0)


def test_graph_is_dropped_only_when_measurably_slower() -> None:
    from gpu_kernels.graph import GRAPH_MARGIN, graph_is_slower

    assert not graph_is_slower(241.91, 241.75)  # timing noise keeps the graph
    assert not graph_is_slower(100.0 * (1 + GRAPH_MARGIN), 100.0)
    assert graph_is_slower(100.0 * (1 + 2 * GRAPH_MARGIN), 100.0)
    assert graph_is_slower(250.0, 100.0)  # cuDNN attention inside a graph, measured 2.5x
    assert not graph_is_slower(90.0, 100.0)


def test_release_resets_the_graph_and_later_calls_run_eagerly() -> None:
    """A rank that captured NCCL collectives releases its graph before its process group is
    destroyed (the teardown would wait for the graph forever): reset() is called, and the step
    still runs after it, eagerly."""

    class CapturedGraph:  # stands in for torch.cuda.CUDAGraph, which a CPU cannot capture
        resets = 0

        def reset(self) -> None:
            self.resets += 1

    runs: list[int] = []

    def step() -> dict[str, torch.Tensor]:
        runs.append(1)
        return {"x": torch.zeros(())}

    graphed = gpu_kernels.GraphedStep(step, warmup=1)
    captured = CapturedGraph()
    graphed.graph = captured  # type: ignore[assignment]
    graphed.release()
    assert captured.resets == 1 and not graphed.captured and graphed.fallback_reason == "graph released"
    graphed.release()  # a second release is harmless
    assert captured.resets == 1
    graphed()
    assert runs == [1]
