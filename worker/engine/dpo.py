"""The DPO recipe: the supervised recipe's loop with the preference objective.

Everything that does not depend on the objective -- data planning, schedule, health checks,
validation cadence, checkpoints, limits, the captured step and its run-ahead -- is the supervised
recipe's (worker/engine/recipe.py). This recipe changes what a step minimises (the sigmoid DPO loss
of worker/engine/preference.py, averaged over the step's pairs, plus rpo_alpha × the chosen answers'
NLL per token), adds one pass before training that computes the reference log-probabilities with
the adapter off, and reports DPO's readings (rewards of the chosen and rejected answers, their
margin, the accuracy, the chosen answers' NLL) per step and per validation pass. A row holds whole
pairs, so `batch_size` counts rows of pairs (one pair a row without packing, as OpenAI's batch_size
counts pairs).

The same code runs eagerly (CPU, families without the fused path) and captured on the GPU: the
captured step takes `PreferenceObjective`, whose static buffers (each loss position's sequence
slot, the reference values, the real-pair mask, the step's 1/N_w) `_host_step` fills on the host.
"""

from __future__ import annotations

import math

import torch

import gpu_kernels
from worker.engine import distributed
from worker.engine.data import IGNORE_INDEX, Batch, BatchSampler, TokenizedDataset, pair_slots
from worker.engine.dataset_rules import PREFERENCE_FORMAT
from worker.engine.fused_model import PackedInputs
from worker.engine.health import dpo_rules
from worker.engine.preference import (
    READINGS,
    PreferenceObjective,
    ReferenceTable,
    batch_logps,
    chosen_tokens,
    eager_loss,
    host_pairs,
    loss_slots,
    metrics_of,
    packed_loss_states,
    reference_table,
    sequence_logps,
    step_counts,
    token_logps,
)
from worker.engine.recipe import LoRAFinetuneRecipe
from worker.engine.step_memory import offloaded
from worker.engine.train_step import HostStep, StepObjective, StepShape, host_step, segment_count
from worker.engine.training_config import DpoTraining
from worker.engine.types import ConfigError, PreferenceMetrics, StepMetrics


class DpoRecipe(LoRAFinetuneRecipe):
    READINGS = READINGS

    @property
    def method(self) -> DpoTraining:
        method = self.config.method
        assert isinstance(method, DpoTraining)
        return method

    @property
    def beta(self) -> float:
        return self.method.beta_value

    @property
    def rpo_alpha(self) -> float:
        return self.method.rpo_alpha_value

    # ------------------------------------------------------------------ hooks of the shared loop

    def _check_format(self, fmt: str, label: str) -> None:
        if fmt != PREFERENCE_FORMAT:
            raise ConfigError(
                "method",
                f"a dpo run needs preference pairs ('input', 'preferred_output', 'non_preferred_output'); "
                f"{label} is in the {fmt!r} format",
            )

    def _prepare_method(self) -> None:
        """π_ref of every training and validation sequence, adapter off, before the first step."""
        stop = self.callbacks.should_stop
        self.callbacks.on_event(
            "info", "Preparing DPO: reference log-probabilities of the base (adapter off)"
        )
        batch = self.config.batch_size
        self.reference = reference_table(
            self.model, self.train_data, batch, self._sequence_logps, should_stop=stop
        )
        self.valid_reference: ReferenceTable | None = None
        if self.valid_data is not None:
            self.valid_reference = reference_table(
                self.model, self.valid_data, batch, self._sequence_logps, should_stop=stop
            )
        self._valid_metrics: PreferenceMetrics | None = None
        # where this run's loss starts: ln 2 + α · the base's NLL of the chosen answers
        self.health.rules = dpo_rules(self.rpo_alpha, self.reference.chosen_nll)

    def _objective(self) -> StepObjective | None:
        return PreferenceObjective(self.beta, self.rpo_alpha)

    def _host_step(self, micro: list[Batch]) -> HostStep:
        host = super()._host_step(micro)
        assert self.step_fn is not None and self.step_fn.shape is not None
        shape = self.step_fn.shape
        parts = self._rank_parts(micro)  # as super() laid them out
        host.pairs = host_pairs(
            parts,
            host.loss_index,
            shape.micro_batches,
            shape.pairs,
            shape.rows,
            shape.seq,
            self.reference,
            step=micro,  # P and N_w of the whole step, on all ranks
        )
        return host

    def _eager_step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Forward + backward of each micro-batch's pairs (this rank's rows), loss Σ / P over the
        step's pairs (+ α · Σ NLL / N_w over its chosen tokens); then clip. (2 + READINGS,) values,
        the optimizer not stepped yet."""
        step_pairs, step_chosen = step_counts(micro_batches)
        values = torch.zeros(1 + READINGS, device=self.device)
        if self.grads is not None:
            self.grads.zero_()
        for part in self._rank_parts(micro_batches):  # this rank's rows, in the memory plan's passes
            with offloaded(self.memory.offload, self.device):
                policy = self._sequence_logps(part)
                loss, readings = eager_loss(
                    policy, self.reference.for_batch(part), self.beta, self.rpo_alpha, step_pairs, step_chosen
                )
            loss.backward()
            values += torch.cat([loss.detach().reshape(1), readings]).float()
        if self.grads is not None:
            values = self.grads.all_reduce_(values)
        norm = gpu_kernels.clip_grad_norm_(self.params, self.config.max_grad_norm)
        return torch.cat([values[:1], norm.float().reshape(1).to(values.device), values[1:]])

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The step's loss over all the held-out pairs (dropout off): mean DPO loss + α · their
        chosen answers' NLL per token; their readings go in the step's report (`_method_metrics`)."""
        if self.valid_data is None or self.valid_reference is None:
            return None
        sums, pairs, tokens = self._score(self.valid_data, self.valid_reference)
        means = torch.cat([sums[:-1] / max(pairs, 1), sums[-1:] / max(tokens, 1)])  # (1 + READINGS,)
        self._valid_metrics = metrics_of(means[1:].tolist())
        return float(means[0]) + self.rpo_alpha * float(means[-1])

    def _score(self, data: TokenizedDataset, table: ReferenceTable) -> tuple[torch.Tensor, int, int]:
        """(Σ DPO loss, Σ r_w, Σ r_l, Σ correct, Σ chosen NLL) over a dataset's pairs (all ranks),
        its pairs and its chosen tokens."""
        sampler = BatchSampler(data, self.config.batch_size, self.config.seed, shuffle=False)
        total = torch.zeros(1 + READINGS, dtype=torch.float64, device=self.device)
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # pairs, chosen tokens
        self.model.eval()
        try:
            for i in range(len(sampler)):
                batch = distributed.shard_rows(sampler.batch(0, i), self.dist)
                if batch is None:
                    continue
                # α 0 and both scales 1: the loss is the Σ of the DPO terms, the readings sums
                policy = self._sequence_logps(batch)
                loss, readings = eager_loss(policy, table.for_batch(batch), self.beta, 0.0, 1, 1)
                total += torch.cat([loss.reshape(1), readings]).double()
                counts[0] += pair_slots(batch)[1]
                counts[1] += chosen_tokens(batch)
        finally:
            self.model.train()
        if self.dist.active:
            stats = torch.cat([total, counts])
            distributed.all_reduce_sum(stats, self.dist)
            total, counts = stats[:-2], stats[-2:]
        return total.cpu(), int(counts[0].item()), int(counts[1].item())

    def _method_metrics(self, metrics: StepMetrics, readings: list[float], validated: bool) -> None:
        if len(readings) == READINGS and all(math.isfinite(x) for x in readings):
            metrics.preference = metrics_of(readings)
        if validated:
            metrics.valid_preference = self._valid_metrics

    # ------------------------------------------------------------------ the forward

    def _sequence_logps(self, batch: Batch) -> torch.Tensor:
        """Each sequence's log-probability (2P,) under the model as it is now, by the forward the
        run's step uses: packed through the fused stack where the step is captured (each batch
        at its own exact shape: this runs eagerly), else the Hugging Face model."""
        if self.step_fn is None:
            return batch_logps(self.model, batch.to(self.device), self._autocast)
        pairs = pair_slots(batch)[1]
        b, t = batch.input_ids.shape
        trained = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
        shape = StepShape(1, b, t, max(segment_count(batch.position_ids), b), max(trained, 1))
        host = host_step([batch], shape)
        d = self.device
        packed = PackedInputs(
            input_ids=host.input_ids.to(d),
            position_ids=host.position_ids.to(d),
            cu_seqlens=host.cu_seqlens.to(d),
            max_seqlen=t,
            loss_index=host.loss_index.to(d),
            loss_targets=host.loss_targets.to(d),
            loss_scale=torch.ones((), device=d),
        )
        head = getattr(self.model, "get_output_embeddings")()  # noqa: B009
        with self._autocast():
            states = packed_loss_states(self.model, packed, 0)  # (M, d)
        lp = token_logps(states, head, packed.loss_targets[0])
        slots = loss_slots([batch], host.loss_index, b, t)[0].to(d)
        return sequence_logps(lp, slots, 2 * pairs)
