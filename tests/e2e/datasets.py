"""Small chat datasets for end-to-end jobs (OpenAI's fine-tuning JSONL format)."""

from __future__ import annotations

import json

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "How many legs does a spider have?",
    "What do bees make?",
    "Which planet is called the red planet?",
    "What is frozen water called?",
    "What gas do plants take in?",
    "How many days are in a week?",
]


def chat_lines(n: int) -> bytes:
    """`n` valid examples; every answer starts with the same marker so the loss can fall fast."""
    rows = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "Answer like a pirate."},
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": f"ARRR! Answer number {i % len(QUESTIONS)}."},
                ]
            }
        )
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def broken_lines() -> bytes:
    """Line 2 is not JSON, line 4 has no `messages`; lines 1 and 3 are fine."""
    good = chat_lines(2).decode().splitlines()
    lines = [good[0], '{"messages": [', good[1], json.dumps({"prompt": "hi", "completion": "there"})]
    return ("\n".join(lines) + "\n").encode()


def varied_chat_lines(n: int) -> bytes:
    """`n` valid examples of many different lengths, so which ones a seeded validation holdout
    takes changes the tokens and rows that are left to train on."""
    rows = []
    for i in range(n):
        answer = "ARRR! " + " ".join(["yo"] * (i % 11)) + f" Answer number {i}."
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return "".join(json.dumps(r) + "\n" for r in rows).encode()
