"""The DPO recipe against TRL's DPOTrainer (issue 33, point 3): the same tiny model, the same
LoRA start, the same pairs, the same optimizer settings; the first steps' losses and rewards agree.

Every step takes all 4 pairs (one batch), so neither side's data order matters. Two cases: DPO alone
(rpo_alpha 0; TRL's loss_type ["sigmoid"]) and DPO + the chosen answers' NLL (our rpo_alpha; TRL
1.16's loss_type ["sigmoid", "sft"] with loss_weights [1, rpo_alpha], its former rpo_alpha), where
TRL's "sft" term is the token mean over the batch's chosen answers, as ours over the step's. Both sides run
AdamW at a constant learning rate with clipping at 1.0 and no weight decay; TRL's reference is the
PEFT model with its adapter disabled, ours the pass with every LoRA scale 0. TRL tokenizes the
conversation with the chat template and trains what follows the prompt; ours trains the answer
through its end-of-turn text: the same tokens for ChatML (checked below before training).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.engine.recipe_helpers import Recorder
from tests.engine.test_dpo import pair, write_pairs
from worker.engine.data import read_valid_examples
from worker.engine.lora import apply_lora, lora_state_dict
from worker.engine.models import LoadedModel
from worker.engine.recipe import train
from worker.engine.training_config import DpoTraining
from worker.engine.types import LoraConfig, TrainConfig

trl = pytest.importorskip("trl")

PAIRS, STEPS, SEED, LR, BETA = 4, 3, 11, 5e-3, 0.1
LORA = LoraConfig(r=4, alpha=8.0)


@pytest.mark.slow
@pytest.mark.parametrize("rpo_alpha", [0.0, 0.7], ids=["dpo", "rpo"])
def test_first_steps_equal_trls_dpo_trainer(tiny: LoadedModel, tmp_path: Path, rpo_alpha: float) -> None:
    from datasets import Dataset
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    # ours: the job's recipe, one step = all pairs (one pair a row), 3 epochs
    rec = Recorder()
    config = TrainConfig(
        model="tiny-llama",
        train_file=write_pairs(tmp_path / "pairs.jsonl", PAIRS),
        output_dir=tmp_path / "out",
        model_store=tmp_path / "models",
        lora=LORA,
        max_seq_len=128,
        batch_size=PAIRS,
        n_epochs=STEPS,
        learning_rate=LR,
        lr_scheduler="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=SEED,
        device="cpu",
        pack=False,
        method=DpoTraining(beta=BETA, rpo_alpha=rpo_alpha),
    )
    train(config, rec, loaded=tiny)
    ours = rec.steps
    assert len(ours) == STEPS

    # TRL: the same base, PEFT LoRA started where the recipe starts (it seeds, then wraps)
    ours_start = copy.deepcopy(tiny.model)
    torch.manual_seed(SEED)
    apply_lora(ours_start, LORA)
    start = lora_state_dict(ours_start)
    peft_config = PeftLoraConfig(
        r=LORA.r, lora_alpha=int(LORA.alpha), lora_dropout=0.0, target_modules="all-linear"
    )
    model = get_peft_model(copy.deepcopy(tiny.model), peft_config)
    result = set_peft_model_state_dict(model, start)  # our keys are PEFT's
    assert not result.unexpected_keys  # type: ignore[attr-defined]
    assert len([n for n, _ in model.named_parameters() if "lora_" in n]) == len(start)
    rows = [pair(i) for i in range(PAIRS)]
    dataset = Dataset.from_list(
        [
            {
                "prompt": r["input"]["messages"],
                "chosen": r["preferred_output"],
                "rejected": r["non_preferred_output"],
            }
            for r in rows
        ]
    )
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=PAIRS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=STEPS,
        beta=BETA,
        loss_type=["sigmoid", "sft"] if rpo_alpha else ["sigmoid"],
        loss_weights=[1.0, rpo_alpha] if rpo_alpha else None,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        gradient_checkpointing=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=SEED,
    )
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny.tokenizer)

    # the same tokens trained on both sides: TRL's prompt + answer ids are our pair's sequences
    examples, _ = read_valid_examples(config.train_file, tiny.tokenizer, 128)
    for i, tokenized in enumerate(trainer.train_dataset):
        ids, labels = examples.tokens_of(i)
        cut = examples.split(i)
        prompt = list(tokenized["prompt_ids"])
        for seq, lab, answer in (
            (ids[:cut], labels[:cut], "chosen_ids"),
            (ids[cut:], labels[cut:], "rejected_ids"),
        ):
            assert seq == prompt + list(tokenized[answer])
            assert [t for t, label in enumerate(lab) if label != -100] == list(range(len(prompt), len(seq)))

    trainer.train()
    theirs = [h for h in trainer.state.log_history if "rewards/margins" in h]
    assert len(theirs) == STEPS
    margins = [o.preference.margin for o in ours if o.preference is not None]
    report = [
        (o.train_loss, t["loss"], m, t["rewards/margins"])
        for o, m, t in zip(ours, margins, theirs, strict=True)
    ]
    for loss, trl_loss, margin, trl_margin in report:
        assert loss == pytest.approx(trl_loss, rel=1e-5), report  # measured: 3e-7
        assert margin == pytest.approx(trl_margin, rel=1e-4, abs=1e-7), report  # measured: 4e-6
    assert report[-1][2] > report[0][2] == pytest.approx(0.0, abs=1e-9)  # it learnt, from r_w = r_l at step 1
    nll = [o.preference.chosen_nll for o in ours if o.preference is not None]
    assert nll[-1] is not None and nll[0] is not None and nll[-1] < nll[0]
    assert (report[0][0] > 1.0) == bool(rpo_alpha)  # log 2 alone, or with 0.7 × the chosen NLL
    print(json.dumps(report))
