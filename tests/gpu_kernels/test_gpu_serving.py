"""Serving on a CUDA device: the KV-cache engine with CUDA-graph decode steps (and the compiled
multi-adapter LoRA kernel inside them) answers, greedily, what transformers' forward answers on
the CPU, with rows of two adapters and the base mixed, rows joining mid-decode and rows ending at
different steps (the cache rows compacted under the captured graphs)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.conftest import TEST_MODEL_STORE
from tests.engine.test_serving import PROMPTS, make_adapter
from worker.engine.models import LoadedModel, load_base_model
from worker.engine.serving import DecodeBatch, GenRequest, GenResult, ServingModel
from worker.engine.types import LoraConfig

pytestmark = [pytest.mark.gpu, pytest.mark.no_memcheck]  # every test here captures graphs or profiles


def on_cuda(tiny: LoadedModel) -> LoadedModel:
    """A copy of `tiny` with its model on the GPU."""
    # transformers wraps PreTrainedModel.cuda in functools.wraps, whose typeshed type hides `self`
    model = copy.deepcopy(tiny.model).cuda()  # type: ignore[call-arg]
    return LoadedModel(model, tiny.tokenizer, "tiny-llama", True)


def _run(
    served: ServingModel, first: list[tuple[str, GenRequest]], later: list[tuple[str, GenRequest]]
) -> dict:
    """Admit `first`, step three times, admit `later`, step to the end: {key: result}."""
    batch = DecodeBatch()
    results: dict[Any, GenResult] = {}
    served.admit(batch, list(first))
    for _ in range(3):
        results.update(served.step(batch))
    served.admit(batch, list(later))
    while batch.rows:
        results.update(served.step(batch))
    return results


def test_graphed_kv_engine_on_cuda_equals_transformers_on_cpu(tmp_path: Path) -> None:
    tiny = load_base_model("tiny-llama", store=TEST_MODEL_STORE)
    adapters = [
        make_adapter(tiny, tmp_path / f"a{i}", seed=i, cfg=LoraConfig(r=4 + 4 * i, alpha=8)) for i in (1, 2)
    ]
    cpu = ServingModel(LoadedModel(copy.deepcopy(tiny.model), tiny.tokenizer, "tiny-llama", True), 2)
    cpu.decoder = None  # transformers' forward over a DynamicCache
    cuda = ServingModel(on_cuda(tiny), 2)
    assert cuda.decoder is not None and cuda.decoder.graphs
    answers = []
    for served in (cpu, cuda):
        s1 = served.adapter_slot("a0", lambda: adapters[0])
        s2 = served.adapter_slot("a1", lambda: adapters[1])
        rows = [(s1, 0, 14), (0, 1, 9), (s2, 2, 16), (s1, 2, 11), (s2, 0, 20), (0, 2, 13)]
        reqs = [
            (f"r{i}", GenRequest(served.prompt_ids(PROMPTS[p]), max_tokens=n, slot=s, temperature=0))
            for i, (s, p, n) in enumerate(rows)
        ]
        answers.append([_run(served, reqs[:3], reqs[3:]) for _ in range(2)])  # 2nd: graphs replayed
    assert cuda.decoder.graph_failure is None
    for cpu_run, cuda_run in zip(*answers, strict=True):
        assert {k: r.text for k, r in cuda_run.items()} == {k: r.text for k, r in cpu_run.items()}
        assert {k: r.completion_tokens for k, r in cuda_run.items()} == {
            k: r.completion_tokens for k, r in cpu_run.items()
        }
    assert len({r.text for r in answers[0][0].values()}) >= 4  # the adapters change the answers


def test_served_steps_launch_the_compiled_lora_kernel(tmp_path: Path) -> None:
    """A served model's weights require grad; its prefill and decode steps (inference mode) still
    run csrc/lora_multi.cu's kernels, not the plain-torch reference."""
    tiny = load_base_model("tiny-llama", store=TEST_MODEL_STORE)
    served = ServingModel(on_cuda(tiny), 1)
    assert any(p.requires_grad for p in served.model.parameters())
    adapter = make_adapter(tiny, tmp_path / "a", seed=1, cfg=LoraConfig(r=4))
    slot = served.adapter_slot("a", lambda: adapter)
    batch = DecodeBatch()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        served.admit(batch, [(0, GenRequest(served.prompt_ids(PROMPTS[0]), 3, slot=slot, temperature=0))])
        served.step(batch)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("shrink_kernel" in n for n in names) and any("expand_kernel" in n for n in names)


def test_decode_steps_are_captured_and_replayed() -> None:
    """After one eager run of a shape, its decode step is a CUDA graph: replays read new tokens."""
    tiny = load_base_model("tiny-llama", store=TEST_MODEL_STORE)
    served = ServingModel(on_cuda(tiny), 1)
    ids = served.prompt_ids(PROMPTS[0])
    batch = DecodeBatch()
    served.admit(batch, [(i, GenRequest(ids, 10, temperature=0)) for i in range(3)])
    while batch.rows:
        served.step(batch)
    assert batch.kv is not None and list(batch.kv.graphs) == [(4, 64)]  # 3 rows padded to 4
    with torch.inference_mode():
        eager = served.decoder._decode_body(batch.kv, 4, 64)[:3].clone()  # type: ignore[union-attr]
    graph = batch.kv.graphs[(4, 64)]
    graph.graph.replay()
    torch.testing.assert_close(graph.logits[:3], eager)
