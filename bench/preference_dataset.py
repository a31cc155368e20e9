"""A seeded synthetic preference (DPO) dataset with long-tailed pair lengths, for the DPO benchmark.

OpenAI's preference format, one pair a line: `input.messages` (one user turn), `preferred_output`
and `non_preferred_output` (one assistant message each). A pair's length is what a training row
holds of it, in tokens of the benchmark presets' tokenizer (tiny-llama's byte-level BPE, which the
random-init presets share) rendered with the chat template: the prompt with the chosen answer plus
the prompt with the rejected one (the prompt counts twice, as the engine and TRL both feed it
twice). Each pair's length is drawn from a log-normal (median 350 tokens, σ = 0.6) and clipped to
[100, 1000]; a share U(0.2, 0.6) of it is prompt (both copies), the rest split between the two
answers with the chosen one's share U(0.35, 0.65). The answers are different random text.

    python bench/preference_dataset.py        # the committed bench/data/preference-longtail.jsonl
    python bench/preference_dataset.py --out /tmp/x.jsonl --n 50 --seed 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chat_dataset import _render, _words, length_stats, resize  # noqa: E402  (after the path insert)

MIN_TOKENS, MAX_TOKENS = 100, 1000
MEDIAN, SIGMA = 350, 0.6
DEFAULT_OUT = ROOT / "bench" / "data" / "preference-longtail.jsonl"
DEFAULT_N, DEFAULT_SEED = 1200, 33


def pair_tokens(tokenizer: Any, prompt: str, chosen: str, rejected: str) -> int:
    """The pair's tokens in a training row: prompt + chosen, then prompt + rejected."""
    return len(_render(tokenizer, prompt, chosen)) + len(_render(tokenizer, prompt, rejected))


def generate(n: int, seed: int) -> list[dict[str, Any]]:
    """n pairs, each within a few tokens of its drawn length."""
    from worker.engine.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    corpus = (ROOT / "worker" / "engine" / "tiny_corpus.txt").read_text().split()
    vocab = sorted({w.strip(".,;:!?\"'()").lower() for w in corpus} - {""})
    rng = random.Random(seed)
    overhead = 2 * len(_render(tokenizer, "a", "a")) - 4  # two templated sequences, bodies aside
    per_word = len(tokenizer(_words(rng, vocab, 400), add_special_tokens=False)["input_ids"]) / 400
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        total = min(MAX_TOKENS, max(MIN_TOKENS, round(math.exp(rng.gauss(math.log(MEDIAN), SIGMA)))))
        body = total - overhead
        prompt_tokens = max(2, round(body * rng.uniform(0.2, 0.6) / 2))  # one copy of two
        answers = max(2, body - 2 * prompt_tokens)
        chosen_tokens = max(1, round(answers * rng.uniform(0.35, 0.65)))
        prompt = _words(rng, vocab, round(prompt_tokens / per_word))
        chosen = _words(rng, vocab, round(chosen_tokens / per_word))
        rejected = _words(rng, vocab, round((answers - chosen_tokens) / per_word))
        for _ in range(3):  # trim or extend the chosen answer to the drawn length
            have = pair_tokens(tokenizer, prompt, chosen, rejected)
            if abs(have - total) <= 3:
                break
            chosen = resize(chosen, total - have, per_word, rng, vocab)
        rows.append(
            {
                "input": {"messages": [{"role": "user", "content": prompt}]},
                "preferred_output": [{"role": "assistant", "content": chosen}],
                "non_preferred_output": [{"role": "assistant", "content": rejected}],
            }
        )
    return rows


def pair_lengths(rows: list[dict[str, Any]]) -> list[int]:
    from worker.engine.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return [
        pair_tokens(
            tok,
            r["input"]["messages"][0]["content"],
            r["preferred_output"][0]["content"],
            r["non_preferred_output"][0]["content"],
        )
        for r in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args()
    rows = generate(args.n, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps(length_stats(pair_lengths(rows))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
