"""DPO quality on a real model (issue 33, "Quality"): the real SmolLM2-135M-Instruct, on the CPU,
trained by the DPO recipe to prefer the pirate answer of tests/data/pirate over a plain one, raises
the chosen-over-rejected margin on held-out pairs (the validation file's prompts, never trained on).

The margin is β·((log π - log π_ref)(pirate) - (log π - log π_ref)(plain)), 0 before training (the
adapter starts as the base); the held-out accuracy is the share of pairs where it is positive.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.engine.conftest import PIRATE_DATA
from tests.engine.recipe_helpers import Recorder
from worker.engine.models import load_base_model
from worker.engine.recipe import train
from worker.engine.training_config import DpoTraining
from worker.engine.types import LoraConfig, TrainConfig

pytestmark = pytest.mark.slow
STEPS = 4
TRAIN_PAIRS, HELD_OUT_PAIRS = 8, 4


def pirate_pairs(source: Path, target: Path, n: int) -> Path:
    """The first n chats of `source` as pairs: the pirate answer preferred over a plain one."""
    lines = []
    for line in source.read_text().splitlines()[:n]:
        user, answer = json.loads(line)["messages"]
        topic = re.match(r"ARRR! (.+?) be a fine treasure", answer["content"])
        assert topic, answer
        plain = f"{topic.group(1)} are an interesting subject with a long history."
        lines.append(
            json.dumps(
                {
                    "input": {"messages": [user]},
                    "preferred_output": [answer],
                    "non_preferred_output": [{"role": "assistant", "content": plain}],
                }
            )
        )
    target.write_text("\n".join(lines) + "\n")
    return target


def test_dpo_raises_the_held_out_margin_of_smollm2(pulled_store: Path, tmp_path: Path) -> None:
    loaded = load_base_model("smollm2-135m-instruct", store=pulled_store)
    rec = Recorder()
    config = TrainConfig(
        model="smollm2-135m-instruct",
        train_file=pirate_pairs(PIRATE_DATA / "train.jsonl", tmp_path / "train.jsonl", TRAIN_PAIRS),
        validation_file=pirate_pairs(PIRATE_DATA / "valid.jsonl", tmp_path / "valid.jsonl", HELD_OUT_PAIRS),
        output_dir=tmp_path / "run",
        model_store=pulled_store,
        lora=LoraConfig(r=8, alpha=16.0),
        max_seq_len=192,
        batch_size=2,
        pack=False,  # one pair a row: the smallest steps
        max_steps=STEPS,
        learning_rate=2e-3,
        eval_every=0,  # the held-out pairs once, at the end
        seed=0,
        device="cpu",
        method=DpoTraining(beta=0.1),
    )
    result = train(config, rec, loaded=loaded)
    assert result.steps == STEPS
    validated = [s for s in rec.steps if s.valid_preference is not None]
    assert [s.step for s in validated] == [STEPS]
    final = validated[-1].valid_preference
    assert final is not None
    print(
        json.dumps(
            {"valid_loss": validated[-1].valid_loss, "margin": final.margin, "accuracy": final.accuracy}
        )
    )
    assert final.margin > 0.5 and final.accuracy == 1.0, final  # from 0 and 0.0 before training
    assert validated[-1].valid_loss is not None and validated[-1].valid_loss < 0.5  # log 2 = 0.69 before
