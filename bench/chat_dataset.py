"""A seeded synthetic chat dataset whose lengths follow a long tail, for the job-path benchmark.

Lengths are in tokens of the benchmark presets' tokenizer (tiny-llama's byte-level BPE, which the
random-init presets share), rendered with the chat template, as the engine counts them. Each
example's total length is drawn from a log-normal (median 300 tokens, σ = 0.9) and clipped to
[20, 2000]; a share U(0.2, 0.7) of it is the user's prompt (no loss), the rest the assistant's
answer (trained). So about half of the tokens are prompt, as in real chat data, most examples are
short and a few are long: the shape that makes padding expensive.

    python bench/chat_dataset.py --out bench/data/chat-longtail.jsonl          # the committed file
    python bench/chat_dataset.py --out /tmp/x.jsonl --n 500 --seed 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIN_TOKENS, MAX_TOKENS = 20, 2000
MEDIAN, SIGMA = 300, 0.9
DEFAULT_OUT = ROOT / "bench" / "data" / "chat-longtail.jsonl"

# one example: {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}
ChatRow = dict[str, list[dict[str, str]]]


def target_lengths(n: int, rng: random.Random) -> list[int]:
    return [
        min(MAX_TOKENS, max(MIN_TOKENS, round(math.exp(rng.gauss(math.log(MEDIAN), SIGMA)))))
        for _ in range(n)
    ]


def _words(rng: random.Random, vocab: list[str], count: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(max(1, count)))


def generate(n: int, seed: int) -> list[ChatRow]:
    """n chat examples, each within a few tokens of its drawn length (at least MIN_TOKENS)."""
    from worker.engine.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    corpus = (ROOT / "worker" / "engine" / "tiny_corpus.txt").read_text().split()
    vocab = sorted({w.strip(".,;:!?\"'()").lower() for w in corpus} - {""})
    rng = random.Random(seed)
    lengths = target_lengths(n, rng)
    # template overhead and tokens per word, measured once
    overhead = len(_render(tokenizer, "a", "a")) - 2
    sample = _words(rng, vocab, 400)
    per_word = len(tokenizer(sample, add_special_tokens=False)["input_ids"]) / 400
    rows: list[ChatRow] = []
    for total in lengths:
        body = max(2, total - overhead)
        prompt_tokens = max(1, round(body * rng.uniform(0.2, 0.7)))
        answer_tokens = max(1, body - prompt_tokens)
        prompt = _words(rng, vocab, round(prompt_tokens / per_word))
        answer = _words(rng, vocab, round(answer_tokens / per_word))
        # one correction pass: trim or extend the answer to the drawn length
        for _ in range(3):
            have = len(_render(tokenizer, prompt, answer))
            if abs(have - total) <= 3 or (have < total and total <= MIN_TOKENS):
                break
            answer = resize(answer, total - have, per_word, rng, vocab)
        rows.append(
            {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
        )
    return rows


def resize(text: str, tokens: int, per_word: float, rng: random.Random, vocab: list[str]) -> str:
    """`text` about `tokens` tokens longer (more random words) or shorter (words cut off the end;
    one word at least)."""
    words = text.split()
    delta = round(tokens / per_word)
    if delta < 0:
        return " ".join(words[: max(1, len(words) + delta)])
    return text + " " + _words(rng, vocab, delta)


def _render(tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def length_stats(lengths: list[int]) -> dict[str, float]:
    s = sorted(lengths)

    def q(p: float) -> int:
        return s[min(len(s) - 1, int(p * len(s)))]

    return {
        "examples": len(s),
        "tokens": sum(s),
        "min": s[0],
        "p10": q(0.1),
        "median": q(0.5),
        "mean": round(sum(s) / len(s), 1),
        "p90": q(0.9),
        "p99": q(0.99),
        "max": s[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=12)
    args = parser.parse_args()
    rows = generate(args.n, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from worker.engine.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    lengths = [len(_render(tok, r["messages"][0]["content"], r["messages"][1]["content"])) for r in rows]
    print(json.dumps(length_stats(lengths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
