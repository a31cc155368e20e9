"""DPO on the recipe's step: the sigmoid loss, sequence log-probabilities and the reference table.

Direct Preference Optimization (Rafailov et al. 2023; TRL's `loss_type="sigmoid"`) with the chosen
answers' negative log-likelihood beside it (RPO, Pang et al. 2024; TRL's `rpo_alpha`, in TRL 1.16
`loss_type=["sigmoid", "sft"]` with `loss_weights=[1, α]`). For a pair (x, y_w, y_l) -- prompt,
preferred (chosen) and non-preferred (rejected) answer -- with the policy π (the base with the
adapter) and the reference π_ref (the same base, adapter off):

    logp(y | x) = Σ_{t in the answer} log π(y_t | x, y_<t)          the answer's trained tokens
    r_w = β · (logp_π(y_w | x) - logp_ref(y_w | x))                the chosen "reward"
    r_l = β · (logp_π(y_l | x) - logp_ref(y_l | x))                the rejected one
    L   = Σ_pairs -log σ(r_w - r_l) / P  +  α · Σ_pairs -logp_π(y_w | x) / N_w

P = the pairs of the whole optimizer step, N_w = the trained tokens of its chosen answers: the NLL
term is a mean over the chosen answers' tokens, as TRL's "sft" term (its `-logps[chosen_mask].mean()`
over the batch; per-sequence means would weigh a short answer's tokens more). P and N_w count every
micro-batch and every rank of the step, so accumulating micro-batches (or ranks) gives the gradient
of one large batch, as the supervised loss divides by the step's tokens. (TRL divides each
micro-batch by its own counts and averages the micro-batches: the same for one micro-batch a step.)
The readings are TRL's `rewards/*`, means over the step's pairs: chosen r_w, rejected r_l, margin
r_w - r_l, accuracy [r_w > r_l]; and the chosen answers' NLL per token, Σ / N_w (TRL's `nll_loss`).

Layout: a pair is one example of two sequences (worker/engine/data.py); a row holds whole pairs,
and `pair_slots` numbers a batch's sequences 2·pair + side (side 0 chosen, 1 rejected). A sequence's
log-probability is the sum of its trained tokens' log-probabilities, gathered by slot.

Reference: the base is frozen, so π_ref's log-probabilities are a function of the data alone. They
are computed once before training (`reference_table`: one forward pass over the train and
validation rows with every LoRA scale set to 0, so no second model is held in memory) and looked up
per batch by its rows. Inside a captured CUDA graph the adapter could not be switched off anyway
(the graph replays what it recorded): the captured step reads the reference values from a static
buffer that each step refills (`PreferenceObjective`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.data import IGNORE_INDEX, Batch, BatchSampler, TokenizedDataset, pair_slots
from worker.engine.fused_model import PackedInputs, packed_loss_states
from worker.engine.lora import lora_modules
from worker.engine.types import PreferenceMetrics, StopRequested

# Σ r_w, Σ r_l, Σ [r_w > r_l] over a micro-batch's pairs (each × the step's 1/P) and Σ of its chosen
# answers' token NLLs (× the step's 1/N_w)
READINGS = 4


def token_logps(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """log π(target) of each row of hidden (N, d) under the LM head, (N,) in at least fp32; 0 where
    the target is IGNORE_INDEX. Logits (N, V) in the hidden dtype, the log-softmax in fp32 (fp64
    stays fp64), as the supervised loss takes its cross-entropy."""
    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return -F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")


def sequence_logps(token_lp: torch.Tensor, slots: torch.Tensor, n_slots: int) -> torch.Tensor:
    """Σ of token log-probs (N,) by sequence slot (N,) int64 -> (n_slots,). Entries whose token
    log-prob is 0 (padding) add nothing wherever their slot points."""
    out = torch.zeros(n_slots, dtype=token_lp.dtype, device=token_lp.device)
    return out.index_add(0, slots, token_lp)


def dpo_terms(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards), each (..., P), from sequence log-probs (..., 2P)
    laid out chosen₀, rejected₀, chosen₁, ... (`pair_slots`)."""
    reference = reference.to(policy.dtype)
    chosen = beta * (policy[..., 0::2] - reference[..., 0::2])
    rejected = beta * (policy[..., 1::2] - reference[..., 1::2])
    return -F.logsigmoid(chosen - rejected), chosen, rejected


def pair_readings(chosen: torch.Tensor, rejected: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(3,) sums over the real pairs (mask 1; padding 0): Σ r_w, Σ r_l, Σ [r_w > r_l]."""
    mask = mask.to(chosen.dtype)
    return torch.stack(
        [(chosen * mask).sum(), (rejected * mask).sum(), ((chosen > rejected).to(chosen.dtype) * mask).sum()]
    ).detach()


def preference_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    rpo_alpha: float,
    pair_scale: torch.Tensor | float,
    token_scale: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, readings (READINGS,)) of one micro-batch's sequences (2Q,) (`pair_slots` order), its
    real pairs `mask` (Q,): Σ -log σ(r_w - r_l) · pair_scale + α · Σ -logp(y_w) · token_scale, where
    the scales are the step's 1/P and 1/N_w. The eager and the captured step both take it."""
    losses, chosen, rejected = dpo_terms(policy, reference, beta)
    mask = mask.to(losses.dtype)
    # Σ of the chosen answers' token NLLs: a sequence's log-prob is the Σ of its tokens' (0 on padding)
    nll = -(policy[..., 0::2] * mask).sum()
    loss = (losses * mask).sum() * pair_scale + rpo_alpha * (nll * token_scale)
    readings = torch.cat(
        [pair_readings(chosen, rejected, mask) * pair_scale, (nll * token_scale).detach().reshape(1)]
    )
    return loss, readings


def chosen_tokens(batch: Batch) -> int:
    """N_w of a batch: the trained tokens of its chosen answers (even `pair_slots` slots)."""
    slots, _ = pair_slots(batch)
    keep = batch.labels[:, 1:] != IGNORE_INDEX  # label t + 1 is predicted at position t
    return int((slots[:, 1:][keep] % 2 == 0).sum())


def step_counts(batches: Sequence[Batch]) -> tuple[int, int]:
    """(P, N_w) of a step's micro-batches: their pairs and their chosen answers' trained tokens,
    the divisors of the DPO term and of the NLL term."""
    return sum(pair_slots(b)[1] for b in batches), sum(chosen_tokens(b) for b in batches)


def metrics_of(means: Sequence[float]) -> PreferenceMetrics:
    """The readings' step means (Σ / P and Σ / N_w, as the step returns them) as the job reports them."""
    chosen, rejected, accuracy, nll = (float(x) for x in means)
    return PreferenceMetrics(chosen, rejected, chosen - rejected, accuracy, nll)


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model alone: every LoRA layer's scale 0 (s·B·A adds exactly nothing), restored on
    exit. Eager only: a captured graph would keep the scales it recorded."""
    layers = list(lora_modules(model).values())
    scales = [layer.scale for layer in layers]
    for layer in layers:
        layer.scale = 0.0
    try:
        yield
    finally:
        for layer, scale in zip(layers, scales, strict=True):
            layer.scale = scale


# ----------------------------------------------------------------------------- reference table


@dataclass
class ReferenceTable:
    """π_ref's log-probability of every sequence of a dataset: `values` (S,) float64, row r's
    sequences at values[starts[r]:starts[r + 1]] (chosen₀, rejected₀, chosen₁, ...)."""

    values: torch.Tensor  # (S,) float64, S = 2 · the dataset's pairs
    starts: torch.Tensor  # (rows + 1,) int64
    chosen_tokens: int  # N_w of the whole dataset: its chosen answers' trained tokens

    @property
    def chosen_nll(self) -> float:
        """The base's NLL of the dataset's chosen answers per token: where the NLL term starts."""
        return -float(self.values[0::2].sum()) / max(self.chosen_tokens, 1)

    def for_batch(self, batch: Batch) -> torch.Tensor:
        """(2P,) float64: the batch's sequences in `pair_slots` order (its rows in batch order)."""
        if batch.row_ids is None:
            raise ValueError("a preference batch needs its dataset rows (BatchSampler sets row_ids)")
        spans = [self.values[int(self.starts[r]) : int(self.starts[r + 1])] for r in batch.row_ids.tolist()]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.float64)


BatchLogps = Callable[[Batch], torch.Tensor]  # a batch -> its sequences' log-probs (2P,)
STOP_CHECK_BATCHES = 16  # reference batches between two should_stop questions


@torch.no_grad()
def reference_table(
    model: nn.Module,
    data: TokenizedDataset,
    batch_size: int,
    logps: BatchLogps,
    *,
    should_stop: Callable[[], bool] | None = None,
) -> ReferenceTable:
    """One pass over `data`'s rows in order, adapter off and dropout off: π_ref of every sequence.
    `logps` is the run's own forward (eager or packed), so the reference is computed as the policy
    is: at step 1 (B = 0) the two are equal and the loss is log 2."""
    sampler = BatchSampler(data, batch_size, seed=0, shuffle=False)
    values: list[torch.Tensor] = []
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        with adapters_off(model):
            for i in range(len(sampler)):
                if (
                    should_stop is not None
                    and i % STOP_CHECK_BATCHES == STOP_CHECK_BATCHES - 1
                    and should_stop()
                ):
                    raise StopRequested("stopped while computing the reference log-probabilities")
                batch = sampler.batch(0, i)
                values.append(logps(batch).detach().double().cpu())
                tokens += chosen_tokens(batch)
    finally:
        model.train(was_training)
    per_row = data.rows.segments()  # (rows,) sequences: two a pair
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(per_row, 0)])
    flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    assert flat.numel() == int(starts[-1]), (flat.numel(), int(starts[-1]))
    return ReferenceTable(flat, starts, tokens)


# ----------------------------------------------------------------------------- eager step


def batch_logps(model: nn.Module, batch: Batch, autocast: Callable[[], torch.autocast]) -> torch.Tensor:
    """The eager (Hugging Face) forward: each sequence's log-probability, (2P,). Hidden (B, T, H)
    → the trained positions (N, H) → head → log-probs (N,) → Σ by slot."""
    with autocast():
        decoder = getattr(model, "base_model")  # noqa: B009
        head = getattr(model, "get_output_embeddings")()  # noqa: B009
        hidden = decoder(**batch.model_inputs()).last_hidden_state  # (B, T, H)
        targets = batch.labels[:, 1:]  # (B, T-1): label t+1 is predicted at position t
        keep = targets != IGNORE_INDEX
        selected = hidden[:, :-1][keep]  # (N, H)
    slots, pairs = pair_slots(batch)
    lp = token_logps(selected, head, targets[keep])
    return sequence_logps(lp, slots[:, 1:][keep].to(lp.device), 2 * pairs)


def eager_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    beta: float,
    rpo_alpha: float,
    step_pairs: int,
    step_chosen_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, readings) of one micro-batch's sequences (2P,) as a share of a step of `step_pairs`
    pairs whose chosen answers have `step_chosen_tokens` trained tokens (`preference_loss`)."""
    mask = torch.ones(policy.shape[-1] // 2, dtype=policy.dtype, device=policy.device)
    return preference_loss(
        policy,
        reference.to(policy.device),
        mask,
        beta,
        rpo_alpha,
        1.0 / max(step_pairs, 1),
        1.0 / max(step_chosen_tokens, 1),
    )


# ----------------------------------------------------------------------------- captured step


@dataclass
class HostPairs:
    """A packed step's pair layout and reference values, CPU tensors for `PreferenceObjective`."""

    loss_slot: torch.Tensor  # (k, M) int64: the sequence slot (2·pair + side) of each loss entry
    reference: torch.Tensor  # (k, 2Q) float64: π_ref of each slot (0 on padding pairs)
    pair_mask: torch.Tensor  # (k, Q): 1 on real pairs
    pairs: int  # P: real pairs of the whole step (all ranks): the loss divides by it
    chosen_tokens: int  # N_w: the whole step's chosen answers' trained tokens (the NLL's divisor)


def host_pairs(
    batches: Sequence[Batch],
    loss_index: torch.Tensor,
    micro_batches: int,
    max_pairs: int,
    rows: int,
    seq: int,
    table: ReferenceTable,
    step: Sequence[Batch] | None = None,
) -> HostPairs:
    """Lay the micro-batches' pairs out for a step of `micro_batches` × `max_pairs` (Q) pair slots:
    the slot of each of `loss_index` (k, M)'s positions (flat b·T + t in the step's (B, T) =
    (`rows`, `seq`) layout, train_step.host_step, predicting
    t + 1, of the same sequence: a sequence's first token is never trained), the reference values
    and the mask of real pairs. Padding entries (target -100) contribute a log-prob of 0. P and
    N_w count `step`, the whole step's micro-batches on every rank (default: `batches`)."""
    reference = torch.zeros(micro_batches, 2 * max_pairs, dtype=torch.float64)
    mask = torch.zeros(micro_batches, max_pairs, dtype=torch.float64)
    for i, batch in enumerate(batches):
        pairs = pair_slots(batch)[1]
        if pairs > max_pairs:
            raise ValueError(f"micro-batch {i} has {pairs} pairs, over the step's {max_pairs}")
        reference[i, : 2 * pairs] = table.for_batch(batch)
        mask[i, :pairs] = 1.0
    slots = loss_slots(batches, loss_index, rows, seq)
    return HostPairs(slots, reference, mask, *step_counts(batches if step is None else step))


def loss_slots(batches: Sequence[Batch], loss_index: torch.Tensor, rows: int, seq: int) -> torch.Tensor:
    """(k, M) int64: the sequence slot of each loss position of `loss_index` (k, M), flat b·T + t
    in host_step's (B, T) = (`rows`, `seq`) layout of micro-batch i (0 for unused entries)."""
    out = torch.zeros(loss_index.shape, dtype=torch.int64)
    for i, batch in enumerate(batches):
        slots = pair_slots(batch)[0]  # (b, t)
        b, t = slots.shape
        laid = torch.zeros(rows, seq, dtype=torch.int64)
        laid[:b, :t] = slots.clamp(min=0)
        out[i] = laid.reshape(-1)[loss_index[i]]
    return out


class PreferenceObjective:
    """The DPO objective of the captured packed step (train_step.StepObjective): static buffers
    for the pair layout, the reference values and the step's 1/N_w, refilled by every `load`."""

    readings = READINGS

    def __init__(self, beta: float, rpo_alpha: float) -> None:
        self.beta = beta
        self.rpo_alpha = rpo_alpha  # a constant of the captured graph, as beta
        self.loss_slot: torch.Tensor | None = None
        self.reference: torch.Tensor | None = None
        self.pair_mask: torch.Tensor | None = None
        self.token_scale: torch.Tensor | None = None  # () 1 / N_w of the step

    def allocate(self, micro_batches: int, loss_tokens: int, max_pairs: int, device: torch.device) -> None:
        self.loss_slot = torch.zeros(micro_batches, loss_tokens, dtype=torch.int64, device=device)
        dtype = torch.float32 if device.type == "cuda" else torch.float64
        self.reference = torch.zeros(micro_batches, 2 * max_pairs, dtype=dtype, device=device)
        self.pair_mask = torch.zeros(micro_batches, max_pairs, dtype=dtype, device=device)
        self.token_scale = torch.ones((), dtype=dtype, device=device)

    def copies(self, pairs: HostPairs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(static buffer, host tensor) pairs for the step's loader."""
        assert self.loss_slot is not None and self.reference is not None and self.pair_mask is not None
        assert self.token_scale is not None
        return [
            (self.loss_slot, pairs.loss_slot),
            (self.reference, pairs.reference),
            (self.pair_mask, pairs.pair_mask),
            (self.token_scale, torch.tensor(1.0 / max(pairs.chosen_tokens, 1), dtype=torch.float64)),
        ]

    def micro_loss(self, model: nn.Module, packed: PackedInputs, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, readings) of micro-batch i: its pairs × the step's 1/P (`packed.loss_scale`), its
        chosen answers' NLL × the step's 1/N_w (`token_scale`), as `preference_loss`."""
        assert self.loss_slot is not None and self.reference is not None and self.pair_mask is not None
        assert self.token_scale is not None
        head = getattr(model, "get_output_embeddings")()  # noqa: B009
        states = packed_loss_states(model, packed, i)  # (M, d)
        lp = token_logps(states, head, packed.loss_targets[i])  # (M,), 0 on padding entries
        policy = sequence_logps(lp, self.loss_slot[i], self.reference.shape[1])  # (2Q,)
        return preference_loss(
            policy,
            self.reference[i],
            self.pair_mask[i],
            self.beta,
            self.rpo_alpha,
            packed.loss_scale.to(policy.dtype),
            self.token_scale.to(policy.dtype),
        )


LOG2 = math.log(2.0)  # the DPO term of a policy equal to its reference (r_w = r_l = 0)
