"""The shared line rules (worker/engine/dataset_rules.py): a JSON error names the column where the
line goes wrong, counted on that line, also when the line ends too early."""

from __future__ import annotations

import pytest

from worker.engine.dataset_rules import LineProblem, parse_line

CHAT = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        # the closing brace is missing: the error is at the end of the line, with or without its
        # newline (json counts that newline as a line of its own: "line 2 column 1")
        (CHAT + b"\n", f"Expecting ',' delimiter at column {len(CHAT) + 1} (the end of the line)"),
        (CHAT + b"\r\n", f"Expecting ',' delimiter at column {len(CHAT) + 1} (the end of the line)"),
        (CHAT, f"Expecting ',' delimiter at column {len(CHAT) + 1} (the end of the line)"),
        # counted in characters: "é" is one (byte 18)
        (b'{"text": "caf\xc3\xa9" "x"}\n', "Expecting ',' delimiter at column 17"),
        (b"{not json}\n", "Expecting property name enclosed in double quotes at column 2"),
    ],
)
def test_json_errors_name_the_column_on_the_line(raw: bytes, reason: str) -> None:
    with pytest.raises(LineProblem) as info:
        parse_line(raw)
    assert str(info.value) == f"not valid JSON: {reason}"
