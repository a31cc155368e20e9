"""The multi-GPU code path on CPU: 2 gloo ranks under torchrun train the same adapter as one process.

One process trains on whole batches; two ranks each train on their rows of every batch and sum
their adapter gradients (one flat all_reduce). Same data order, same init, same optimizer, the
loss divided by the trainable tokens of the whole step: gradients and losses agree to fp32
rounding, and rank 0 alone reports one step per optimizer step (one loss curve). The first test
runs the worker's launcher (`run_torchrun`, the CPU's Hugging Face step); the packed-step test
runs the job path's packed step with the fused modules forced on (reference ops).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import load_file

import gpu_kernels
from gpu_kernels.dispatch import KernelStatus
from tests.deploy import packed_rank
from worker.engine import distributed, recipe
from worker.engine.checkpoint import TRAINING_STATE, checkpoint_dir
from worker.engine.data import BatchSampler, Examples, TokenizedDataset, pack_examples
from worker.engine.types import CheckpointInfo, LoraConfig, NodeFailed, Rendezvous, StepMetrics, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL_STORE = ROOT / "var" / "test-models" / "models"  # tiny-llama is built here once (engine tests too)


class Recorder:
    def __init__(self, stop_after: int | None = None) -> None:
        self.steps: list[StepMetrics] = []
        self.events: list[str] = []
        self.checkpoints: list[CheckpointInfo] = []
        self.stop_after = stop_after

    def on_step(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)

    def on_event(
        self, level: Literal["info", "warn", "error"], message: str, data: dict[str, Any] | None = None
    ) -> None:
        self.events.append(message)

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        self.checkpoints.append(checkpoint)

    def should_stop(self) -> bool:
        return self.stop_after is not None and len(self.steps) >= self.stop_after


def write_dataset(path: Path, n: int = 9) -> Path:
    """Rows of different lengths, so that ranks see different padding and token counts."""
    rows = []
    for i in range(n):
        answer = " ".join(["arr"] * (1 + 3 * i)) + f" number {i}."
        rows.append({"messages": [{"role": "user", "content": f"Question {i}?" + " why" * (i % 4)},
                                  {"role": "assistant", "content": answer}]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_config(tmp_path: Path, out: str, **overrides: object) -> TrainConfig:
    base = TrainConfig(
        model="tiny-llama",
        train_file=write_dataset(tmp_path / "train.jsonl"),
        validation_file=write_dataset(tmp_path / "valid.jsonl", n=5),  # 3+2 rows: ranks split each batch
        output_dir=tmp_path / out,
        model_store=MODEL_STORE,
        lora=LoraConfig(r=4, alpha=8.0, dropout=0.0),
        max_seq_len=128,
        # 3 rows per micro-batch (ranks get 2 and 1 rows), 2 micro-batches per step, 3 steps;
        # packing on (the job default): the 9 lines make 5 rows
        pack=True,
        batch_size=3,
        grad_accum=2,
        max_steps=3,
        learning_rate=1e-2,
        lr_scheduler="constant",
        seed=7,
        device="cpu",
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(adapter_dir / "adapter_model.safetensors"))


@pytest.mark.timeout(300)
def test_two_gloo_ranks_match_one_process(tmp_path: Path) -> None:
    single_cb = Recorder()
    single = recipe.train(make_config(tmp_path, "single"), single_cb)

    ddp_cb = Recorder()
    ddp = distributed.run_torchrun(
        make_config(tmp_path, "ddp"), ddp_cb, n_gpus=2, workdir=tmp_path / "ddp-run"
    )

    # One curve: rank 0 alone reported, one row per optimizer step, same losses as one process.
    assert [m.step for m in ddp_cb.steps] == [1, 2, 3]
    assert [m.tokens for m in ddp_cb.steps] == [m.tokens for m in single_cb.steps]
    for a, b in zip(ddp_cb.steps, single_cb.steps, strict=True):
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    # validation (at the last step) is sharded across ranks too, and sums to the same mean
    assert single_cb.steps[-1].valid_loss is not None
    assert ddp_cb.steps[-1].valid_loss == pytest.approx(single_cb.steps[-1].valid_loss, rel=1e-6)
    assert ddp.final_valid_loss == pytest.approx(single.final_valid_loss, rel=1e-6)
    assert ddp.steps == single.steps == 3
    assert ddp.trained_tokens == single.trained_tokens
    assert [c.step for c in ddp_cb.checkpoints] == [3]
    assert sum("Adapter exported" in e for e in ddp_cb.events) == 1
    # each rank marks that its training returned (what tells a finished host from a stopped one)
    finished = sorted(f.name for f in (tmp_path / "ddp-run").glob(f"{distributed.FINISHED_PREFIX}*"))
    assert finished == ["finished-0", "finished-1"]

    want, got = adapter_tensors(single.adapter_dir), adapter_tensors(ddp.adapter_dir)
    assert want.keys() == got.keys() and want
    assert all(bool(w.abs().sum() > 0) for w in want.values())  # every factor trained (B starts at 0)
    # per step the gradients agree to fp32 rounding (the packed-step test below compares them);
    # over 3 steps AdamW amplifies that rounding where a gradient is below its eps: measured 5.6e-6
    assert rel_l2(want, got) < 1e-4


@pytest.mark.timeout(300)
def test_stop_request_reaches_every_rank_and_engine_errors_keep_their_code(tmp_path: Path) -> None:
    cb = Recorder(stop_after=1)
    result = distributed.run_torchrun(
        make_config(tmp_path, "stop", max_steps=50), cb, n_gpus=2, workdir=tmp_path / "stop-run"
    )
    assert result.stopped and 1 <= result.steps < 50

    bad = make_config(tmp_path, "bad")
    bad.train_file.write_text('{"messages": [\n')
    with pytest.raises(distributed.EngineError) as err:
        distributed.run_torchrun(bad, Recorder(), n_gpus=2, workdir=tmp_path / "bad-run")
    assert err.value.code == "invalid_training_file"
    assert "line 1" in str(err.value)


# --------------------------------------------------------------------------- the packed job step


def packed_config(tmp_path: Path, out: str, **overrides: object) -> TrainConfig:
    """Packing on (the job default): 9 examples in 5 rows; 3 rows per micro-batch, 2 micro-batches
    per step (ranks get rows 0, 2 and row 1 of each); 4 steps with a checkpoint at step 2."""
    return make_config(
        tmp_path, out, pack=True, validation_file=None, max_steps=4, checkpoint_every=2, **overrides
    )


def run_ranks(config: TrainConfig, out: Path, n: int = 2) -> list[dict[str, Any]]:
    """`config` on n gloo ranks under torchrun, each rank running tests/deploy/packed_rank.py."""
    out.mkdir(parents=True)
    config_path = out / "config.json"
    config_path.write_text(distributed.config_to_json(config))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
            "-m", "tests.deploy.packed_rank", str(config_path), str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(n)]


def run_single(config: TrainConfig, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True)
    loaded: dict[str, Any] = torch.load(packed_rank.record_run(config, out))
    return loaded


def assert_same_grads(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """fp32 equality up to summation order: every tensor within 1e-5 of its own largest entry."""
    assert len(got) == len(want) and want
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()) + 1e-12)


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    den = sum(float(a[k].pow(2).sum()) for k in a)
    return (num / den) ** 0.5


def assert_resumed_from(run: dict[str, Any], checkpoint: Path) -> None:
    """The adapter and optimizer state right after setup are the checkpoint's, bit for bit."""
    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert run["resumed"]["adapter"].keys() == adapter.keys()
    for k, v in adapter.items():
        assert torch.equal(run["resumed"]["adapter"][k], v), k
    saved = torch.load(checkpoint / TRAINING_STATE, weights_only=True)["optimizer"]["state"]
    state = run["resumed"]["optimizer"]["state"]
    assert state.keys() == saved.keys() and saved
    for i, entry in saved.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(state[i][key]).cpu(), torch.as_tensor(value)), (i, key)


@pytest.mark.timeout(400)
def test_packed_step_two_gloo_ranks_equal_one_process_and_checkpoints_cross(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job path's packed step with packing on: 2 gloo ranks vs one process, in fp32.

    Gradients and loss are compared from the same adapter state: step 1 (same init), and step 3
    of each run resumed from the *other* world size's step-2 checkpoint (which also checks that
    checkpoints cross world sizes: same adapter, same optimizer state, same next step)."""
    monkeypatch.setattr(gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))
    one = run_single(packed_config(tmp_path, "one"), tmp_path / "one-rec")
    two, two_r1 = run_ranks(packed_config(tmp_path, "two"), tmp_path / "two-rec")

    for run in (one, two, two_r1):
        assert run["final"]["packed_step"]
    assert (one["final"]["world_size"], two["final"]["world_size"]) == (1, 2)
    assert [s["step"] for s in two["steps"]] == [1, 2, 3, 4]  # rank 0 alone reports
    assert two_r1["steps"] == []
    assert [s["tokens"] for s in two["steps"]] == [s["tokens"] for s in one["steps"]]
    # the same global batch, the same normaliser: equal gradients and loss from the same state
    assert_same_grads(two["steps"][0]["grads"], one["steps"][0]["grads"])
    for a, b in zip(two["steps"], one["steps"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # one all_reduce leaves every rank the same gradients and adapters, bit for bit
    for g0, g1 in zip(two["final"]["grads"], two_r1["final"]["grads"], strict=True):
        assert torch.equal(g0, g1)
    assert all(torch.equal(two["final"]["adapter"][k], v) for k, v in two_r1["final"]["adapter"].items())
    # over 4 steps AdamW amplifies the rounding where a gradient is below its eps (distributed.py)
    assert rel_l2(one["final"]["adapter"], two["final"]["adapter"]) < 1e-4

    # a two-rank checkpoint resumes in one process, and a one-process checkpoint on two ranks
    two_ckpt, one_ckpt = checkpoint_dir(tmp_path / "two", 2), checkpoint_dir(tmp_path / "one", 2)
    one_from_two = run_single(packed_config(tmp_path, "one-from-two", resume_from=two_ckpt), tmp_path / "r1")
    two_from_one, two_from_one_r1 = run_ranks(
        packed_config(tmp_path, "two-from-one", resume_from=one_ckpt), tmp_path / "r2"
    )
    assert_resumed_from(one_from_two, two_ckpt)
    assert_resumed_from(two_from_one, one_ckpt)
    assert_resumed_from(two_from_one_r1, one_ckpt)
    assert [s["step"] for s in one_from_two["steps"]] == [s["step"] for s in two_from_one["steps"]] == [3, 4]
    # step 3 from one state on either world size: the same gradients and loss
    assert_same_grads(one_from_two["steps"][0]["grads"], two["steps"][2]["grads"])
    assert_same_grads(two_from_one["steps"][0]["grads"], one["steps"][2]["grads"])
    assert one_from_two["steps"][0]["loss"] == pytest.approx(two["steps"][2]["loss"], rel=1e-6)
    assert two_from_one["steps"][0]["loss"] == pytest.approx(one["steps"][2]["loss"], rel=1e-6)
    assert rel_l2(two["final"]["adapter"], one_from_two["final"]["adapter"]) < 1e-4
    assert rel_l2(one["final"]["adapter"], two_from_one["final"]["adapter"]) < 1e-4


@pytest.mark.timeout(300)
def test_per_gpu_batch_scaling_two_ranks_take_half_the_steps_at_sqrt2_the_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batch_scaling per_gpu on 2 gloo ranks (the packed job step): each rank trains batch_size
    rows, so a step is 2x one process's batch and an epoch half its steps, at √2x its rate
    (the square-root rule for Adam, worker/engine/training_config.lr_scale)."""
    monkeypatch.setattr(gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))
    # 8 examples one a row: 4 steps of 2 rows in one process, 2 steps of 2 x 2 rows on 2 ranks
    fields: dict[str, object] = {
        "train_file": write_dataset(tmp_path / "eight.jsonl", n=8),
        "validation_file": None,
        "pack": False,
        "batch_size": 2,
        "grad_accum": 1,
        "max_steps": None,
        "n_epochs": 1,
        "batch_scaling": "per_gpu",
    }
    one = run_single(make_config(tmp_path, "one", **fields), tmp_path / "one-rec")
    two, two_r1 = run_ranks(make_config(tmp_path, "two", **fields), tmp_path / "two-rec")

    assert (one["final"]["total_steps"], two["final"]["total_steps"]) == (4, 2)
    assert [s["step"] for s in two["steps"]] == [1, 2]
    # every rank holds batch_size rows a step, not half of them
    assert one["final"]["rank_rows"] == two["final"]["rank_rows"] == two_r1["final"]["rank_rows"] == 2
    # a 2-rank step is the rows of two one-process steps (the data order does not depend on the
    # batch): its tokens are theirs, summed
    tokens = [s["tokens"] for s in one["steps"]]
    assert [s["tokens"] for s in two["steps"]] == [tokens[0] + tokens[1], tokens[2] + tokens[3]]
    # the constant schedule's rate: as given in one process (per_gpu there is global), √2x on two
    assert [s["lr"] for s in one["steps"]] == [pytest.approx(1e-2)] * 4
    assert [s["lr"] for s in two["steps"]] == [pytest.approx(1e-2 * 2**0.5)] * 2
    (plan,) = [e for e in two["events"] if e.startswith("Plan: ")]
    assert "2 row(s) per GPU x 2 GPUs = 4 row(s)" in plan and "peak learning rate 1.4e-02" in plan
    assert "square-root rule for Adam" in plan


def test_flat_grads_accumulate_in_place_at_fixed_addresses() -> None:
    """What capture needs: the backward adds into the buffer's views (no new .grad tensors), so
    the all_reduce reads every gradient at an address that never changes; zero_ re-points a .grad
    that something replaced (zero_grad(set_to_none=True), a checkpoint load)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    grads = distributed.FlatGrads(params, distributed.SINGLE)
    address = grads.flat.data_ptr()
    x = torch.randn(4)
    for _ in range(2):  # two micro-batches accumulate
        ((params[0] @ x).sum() + params[1].pow(2).sum()).backward()
    assert all(p.grad is v for p, v in zip(params, grads.views, strict=True))
    torch.testing.assert_close(grads.flat[:12].view(3, 4), 2 * x.expand(3, 4))
    torch.testing.assert_close(grads.flat[12:17], 4 * params[1].detach())
    loss = grads.all_reduce_(torch.tensor(1.5, dtype=torch.float64))
    assert float(loss) == 1.5 and loss.data_ptr() == address + 17 * 4
    params[0].grad = None
    grads.zero_()
    assert params[0].grad is grads.views[0] and grads.flat.abs().sum() == 0
    assert grads.flat.data_ptr() == address
    with pytest.raises(ValueError, match="fp32"):
        distributed.FlatGrads([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))], distributed.SINGLE)


def test_cleanup_frees_the_step_graph_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's teardown waits for every CUDA graph holding its kernels, so a job's cleanup frees
    the captured step before distributed.shutdown destroys the process group (on two H100s it
    hung there, after the last step, until this order was kept)."""
    order: list[str] = []

    class Step:  # stands in for CapturedTrainStep, whose graph a CPU cannot capture
        def release(self) -> None:
            order.append("release")

    run = recipe.LoRAFinetuneRecipe.__new__(recipe.LoRAFinetuneRecipe)
    run.__dict__.update(step_fn=Step(), loaded=None, _given=None, dist=distributed.SINGLE)
    monkeypatch.setattr(distributed, "shutdown", lambda ctx: order.append("shutdown"))
    run.cleanup()
    assert order == ["release", "shutdown"] and "step_fn" not in run.__dict__


@pytest.mark.parametrize(
    ("here", "elsewhere", "ahead"), [(False, False, True), (False, True, False), (True, False, False)]
)
def test_ranks_run_ahead_only_when_every_rank_may(
    monkeypatch: pytest.MonkeyPatch, here: bool, elsewhere: bool, ahead: bool
) -> None:
    """Queueing step N + 1 before step N's loss is read is decided by all ranks together (each
    rank's clock decides its time-based checkpoint and wall-clock limit, and every rank must queue
    the same collectives): one exchange, where another rank's due checkpoint holds this one back."""
    exchanged: list[bool] = []

    def any_rank(flag: bool, ctx: distributed.DistContext) -> bool:  # the other rank's answer
        exchanged.append(flag)
        return flag or elsewhere

    run = recipe.LoRAFinetuneRecipe.__new__(recipe.LoRAFinetuneRecipe)
    run.__dict__.update(on_cuda=True, total_steps=10, batches_per_epoch=100, valid_data=None)
    run.__dict__.update(dist=distributed.DistContext(0, 2, 0, True, None))
    monkeypatch.setattr(run, "_checkpoint_due", lambda step, epoch_end: here)
    monkeypatch.setattr(run, "_limit_reason", lambda: None)
    monkeypatch.setattr(distributed, "any_rank", any_rank)
    assert run._may_run_ahead(3, 0, 4) is ahead
    assert exchanged == [here]
    run.__dict__["on_cuda"] = False  # on the CPU nothing runs ahead, and nothing is exchanged
    assert run._may_run_ahead(3, 0, 4) is False and exchanged == [here]


def test_balanced_shards_keep_the_strided_row_counts_and_even_out_the_work() -> None:
    """Each rank trains as many rows as the strided split gives it (the captured step's shape),
    and the rows are dealt so that the slowest rank does less attention work: on packed rows of a
    long-tail chat set, one row with a 1,900-token conversation against rows of short ones."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        world = int(torch.randint(1, 5, (1,), generator=gen))
        work = torch.randint(0, 2_000_000, (n,), generator=gen).tolist()
        shards = distributed.balanced_shards(work, world)
        assert sorted(r for s in shards for r in s) == list(range(n))
        assert [len(s) for s in shards] == [len(range(r, n, world)) for r in range(world)]
        assert all(s == sorted(s) for s in shards)
        assert distributed.balanced_shards(work, world) == shards  # every rank computes the same
        balanced = max(sum(work[i] for i in s) for s in shards)
        strided = max(sum(work[r::world]) for r in range(world))
        assert balanced < strided or shards == [list(range(r, n, world)) for r in range(world)]
    # 8 rows on 4 ranks: the two long-conversation rows (0 and 4) land on one rank when strided
    work = [1_800_000, 200_000, 210_000, 190_000, 1_750_000, 220_000, 205_000, 195_000]
    assert max(sum(work[r::4]) for r in range(4)) == 3_550_000
    shards = distributed.balanced_shards(work, 4)
    assert shards == [[0, 3], [4, 7], [1, 5], [2, 6]]  # each long row with the shortest left
    assert max(sum(work[i] for i in s) for s in shards) == 1_990_000


def test_ranks_shard_a_batch_by_the_work_the_dataset_counts() -> None:
    """The attention work `shard_rows` reads off a collated batch is the work `Rows.attention_work`
    counts from the dataset (what `_step_shape` sizes the captured step with), packed rows and
    preference pairs (two sequences an example) alike; each rank gets its `balanced_shards` rows."""
    lengths = [1900, 40, 60, 30, 500, 700, 90, 1200, 20, 300]
    examples = Examples()
    for i, n in enumerate(lengths):
        cut = n // 3 if i % 3 == 0 else 0  # every third example a preference pair
        examples.append(i + 1, list(range(1, n + 1)), [k % 2 == 0 for k in range(n)], split=cut)
    rows = pack_examples(examples, 2048)
    data = TokenizedDataset(rows, len(lengths), sum(lengths), 0, 2048, True, "chat", 0)
    batch = BatchSampler(data, batch_size=len(rows), seed=5, pad_to=2048).batch(0, 0)
    assert batch.row_ids is not None
    work = distributed.row_attention_work(batch)
    assert torch.equal(work, rows.attention_work()[batch.row_ids])
    expected = sum(c * (c + 1) // 2 + (n - c) * (n - c + 1) // 2 for n, c in
                   ((n, n // 3 if i % 3 == 0 else 0) for i, n in enumerate(lengths)))  # fmt: skip
    assert int(work.sum()) == expected
    world = 2
    shards = distributed.balanced_shards(work.tolist(), world)
    for rank in range(world):
        ctx = distributed.DistContext(rank=rank, world_size=world)
        mine = distributed.shard_rows(batch, ctx)
        assert mine is not None and torch.equal(mine.input_ids, batch.input_ids[shards[rank]])
        assert mine.row_ids is not None and mine.row_ids.tolist() == batch.row_ids[shards[rank]].tolist()
    # more ranks than rows: the ranks past the rows train nothing this micro-batch
    lone = BatchSampler(data, batch_size=1, seed=5, pad_to=2048).batch(0, 0)
    assert distributed.shard_rows(lone, distributed.DistContext(rank=1, world_size=2)) is None


def test_a_host_whose_ranks_were_stopped_mid_job_fails_the_attempt_though_torchrun_exits_0() -> None:
    """A host's torchrun can exit 0 with its ranks stopped mid-job. Seen in a CI run of
    test_multi_node when the host serving the rendezvous was lost (most likely its agent closed
    the rendezvous a moment before dying): the surviving host called that node_done, and the job
    was re-queued only by the lost worker's missing heartbeat, under a message naming no host."""
    rdzv = Rendezvous(
        endpoint="10.253.163.1:40045", run_id="j-1", n_nodes=2, local_addr="10.253.163.2", is_host=False,
        join_timeout_s=30,
    )  # fmt: skip
    distributed.node_failure(rdzv, 0, None, "", unfinished=0)  # the ranks here finished: no failure
    with pytest.raises(NodeFailed) as err:
        distributed.node_failure(rdzv, 0, None, "", unfinished=1)
    assert str(err.value) == (
        "a host of the job's 2 failed (the rendezvous at 10.253.163.1:40045 closed before 1 of this "
        "host's ranks finished)"
    )
    with pytest.raises(NodeFailed, match="torchrun exited with code 1"):  # a crash, as before
        distributed.node_failure(rdzv, 1, None, "", unfinished=1)
