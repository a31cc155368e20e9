"""Datasets: the three JSONL formats, loss masks, validation errors, packing and batching."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.engine.conftest import WriteJsonl, chat
from worker.engine.data import (
    IGNORE_INDEX,
    Batch,
    BatchSampler,
    Example,
    Examples,
    collate,
    load_dataset,
    pack_examples,
    read_examples,
    validate_dataset,
)
from worker.engine.models import LoadedModel
from worker.engine.types import DatasetError


def trained_text(tiny: LoadedModel, ids: list[int], labels: list[int]) -> str:
    text = tiny.tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    assert isinstance(text, str)  # decode's union type covers a batch of sequences too
    return text


def per_token_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """(B, T-1) cross-entropy of logits[:, t-1] against labels[:, t]; 0 where the label is ignored."""
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits.float()
    return F.cross_entropy(
        logits[:, :-1].transpose(1, 2), batch.labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
    )


# ------------------------------------------------------------------------------------------ masks


def test_chat_loss_mask_covers_exactly_weighted_assistant_turns(
    tiny: LoadedModel, write_jsonl: WriteJsonl
) -> None:
    tok = tiny.tokenizer
    row = chat(
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello there!", 0),
        ("user", "What is two plus two?"),
        ("assistant", "Four."),
    )
    examples, report = read_examples(write_jsonl([row]), tok, 256)
    assert report.ok, report.errors
    (ex,) = examples
    # the rendering is the plain ChatML concatenation, tokenized once
    text = tok.apply_chat_template(row["messages"], tokenize=False)
    assert ex.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    # trained: exactly the last assistant turn's content, its <|im_end|> and the turn's newline
    expected = tok("Four.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    expected += tok("\n", add_special_tokens=False)["input_ids"]
    trained = [t for t, lab in zip(ex.input_ids, ex.labels, strict=True) if lab != IGNORE_INDEX]
    assert trained == expected
    assert ex.trainable_tokens == len(expected) == report.trainable_tokens
    # the trained tokens are the last ones of the sequence, contiguous
    assert ex.labels[-len(expected) :] == expected
    assert all(lab == IGNORE_INDEX for lab in ex.labels[: -len(expected)])
    assert "Hello there" not in trained_text(tiny, ex.input_ids, ex.labels)


def test_every_weight_one_assistant_turn_is_trained(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    row = chat(("user", "A?"), ("assistant", "One."), ("user", "B?"), ("assistant", "Two.", 1))
    (ex,), _ = read_examples(write_jsonl([row]), tiny.tokenizer, 256)
    assert trained_text(tiny, ex.input_ids, ex.labels) == "One.<|im_end|>\nTwo.<|im_end|>\n"


def test_conversation_starting_with_assistant(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    (ex,), _ = read_examples(write_jsonl([chat(("assistant", "I speak first."))]), tiny.tokenizer, 64)
    assert trained_text(tiny, ex.input_ids, ex.labels) == "I speak first.<|im_end|>\n"


def test_loss_counts_only_assistant_tokens(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    """The model's mean loss equals the mean over the assistant positions alone."""
    row = chat(("user", "What is the capital of France?"), ("assistant", "Paris."))
    ds = load_dataset(write_jsonl([row]), tiny.tokenizer, 128)
    batch = collate(ds.rows, ds.pad_token_id, packed=False)
    with torch.no_grad():
        hf_loss = tiny.model(**batch.model_inputs(), labels=batch.labels).loss
    losses = per_token_loss(tiny.model, batch)
    mask = batch.labels[:, 1:] != IGNORE_INDEX
    answer = len(tiny.tokenizer("Paris.", add_special_tokens=False)["input_ids"])
    assert int(mask.sum()) == ds.trainable_tokens == answer + 2  # + "<|im_end|>" + "\n"
    assert torch.allclose(hf_loss, losses[mask].mean(), atol=1e-6)


def test_prompt_completion_trains_completion_and_eos(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    tok = tiny.tokenizer
    row = {"prompt": "The capital of France is", "completion": " Paris."}
    ds = load_dataset(write_jsonl([row]), tok, 64)
    assert ds.format == "prompt_completion"
    (r,) = ds.rows
    prompt_ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
    completion_ids = tok(row["completion"], add_special_tokens=False)["input_ids"]
    assert r.input_ids == [*prompt_ids, *completion_ids, tok.eos_token_id]
    assert r.labels == [IGNORE_INDEX] * len(prompt_ids) + [*completion_ids, tok.eos_token_id]


def test_text_trains_every_token_but_the_first(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    tok = tiny.tokenizer
    ds = load_dataset(write_jsonl([{"text": "The quick brown fox."}]), tok, 64)
    (r,) = ds.rows
    ids = [*tok("The quick brown fox.", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert r.input_ids == ids
    assert r.labels == [IGNORE_INDEX, *ids[1:]]
    assert ds.trainable_tokens == len(ids) - 1


# ------------------------------------------------------------------------------------- validation

BAD_LINES: list[tuple[str, str]] = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"foo": "bar"}), "missing field"),
    (json.dumps({"messages": []}), "non-empty list"),
    (json.dumps(chat(("user", "hi"), ("robot", "beep"))), "unknown role 'robot'"),
    (
        json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}),
        "missing field 'content'",
    ),
    (json.dumps({"messages": [{"content": "hi"}]}), "missing field 'role'"),
    (json.dumps(chat(("user", "hi"), ("assistant", "   "))), "messages[1].content is empty"),
    (json.dumps(chat(("user", "hi"), ("assistant", "x", 2))), "weight must be 0 or 1"),
    (json.dumps(chat(("user", "hi", 1), ("assistant", "x"))), "only allowed on assistant"),
    (json.dumps(chat(("system", "s"), ("user", "hi"))), "no assistant message"),
    (json.dumps(chat(("user", "hi"), ("assistant", "x", 0))), "no trainable tokens"),
    (json.dumps(chat(("user", "hi"), ("assistant", "long " * 100))), "longer than max_seq_len 64"),
    (json.dumps({"text": "a text line in a chat file"}), "differs from the file's format 'chat' (line 1)"),
    (json.dumps({"messages": [{"role": "user", "content": 3}]}), "content must be a string"),
]


def test_validation_reports_every_bad_line_with_its_number(
    tiny: LoadedModel, write_jsonl: WriteJsonl
) -> None:
    good = chat(("user", "What is two plus two?"), ("assistant", "Four."))
    path = write_jsonl([good, *[line for line, _ in BAD_LINES], good])
    report = validate_dataset(path, tiny.tokenizer, 64)
    assert report.format == "chat"
    assert report.examples == 2
    assert [e.line for e in report.errors] == list(range(2, 2 + len(BAD_LINES)))
    for error, (_, reason) in zip(report.errors, BAD_LINES, strict=True):
        assert reason in error.reason, (error, reason)
    assert report.tokens > 0 and 0 < report.trainable_tokens < report.tokens

    with pytest.raises(DatasetError) as info:
        load_dataset(path, tiny.tokenizer, 64)
    assert info.value.errors == report.errors
    assert "line 2: not valid JSON" in str(info.value)
    assert info.value.param == "training_file"


def test_upload_check_and_engine_name_the_same_bad_lines(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    """One set of rules (`worker.engine.dataset_rules`): every line the API's upload check refuses,
    the engine refuses with the same words; the engine adds only what needs the tokenizer."""
    from service.api.dataset_summary import check_file

    good = chat(("user", "What is two plus two?"), ("assistant", "Four."))
    structural = [line for line, reason in BAD_LINES if "max_seq_len" not in reason]
    deep = '{"text": "x", "n": ' + "[" * 40 + "]" * 40 + "}"
    surrogate = (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\\ud800"}]}'
    )
    path = write_jsonl([good, *structural, deep, surrogate, good])
    engine = [(e.line, e.reason) for e in validate_dataset(path, tiny.tokenizer, 64).errors]
    upload = [(b.line, b.reason) for b in check_file(path, max_line_bytes=1 << 20).bad_lines]
    assert engine == upload
    assert len(upload) == len(structural) + 2
    assert "nested deeper than 32 levels" in upload[-2][1]
    assert "messages[1].content holds a lone UTF-16 surrogate" in upload[-1][1]


def test_prompt_completion_errors(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    rows = [
        {"prompt": "a", "completion": "b"},
        {"prompt": "only a prompt"},
        {"prompt": "p", "completion": ""},
    ]
    errors = validate_dataset(write_jsonl(rows), tiny.tokenizer, 64).errors
    assert [(e.line, e.reason) for e in errors] == [
        (2, "missing field 'completion' (a prompt/completion line needs both)"),
        (3, "field 'completion' is empty"),
    ]


def test_non_utf8_line_and_blank_lines(tiny: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    good = json.dumps({"text": "hello"}).encode()
    path.write_bytes(good + b"\n\n   \n" + b'{"text": "\xff\xfe"}\n' + good + b"\n")
    report = validate_dataset(path, tiny.tokenizer, 64)
    assert report.examples == 2  # blank lines 2-3 are skipped, not errors
    assert len(report.errors) == 1 and report.errors[0].line == 4 and "not UTF-8" in report.errors[0].reason


def test_empty_file_is_an_error(tiny: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DatasetError, match="no examples"):
        load_dataset(path, tiny.tokenizer, 64, file_label="validation_file")


def test_tokenization_is_linear_in_rows(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    rows = [
        chat(("system", "Be brief."), ("user", f"What is {i} plus {i}?"), ("assistant", f"{2 * i}."))
        for i in range(4000)
    ]
    path = write_jsonl(rows)
    start = time.perf_counter()
    ds = load_dataset(path, tiny.tokenizer, 128)
    elapsed = time.perf_counter() - start
    assert ds.examples == 4000
    # ~2 s on an idle 2-core box (10 s when loaded); a quadratic implementation takes many minutes
    assert elapsed < 45, f"tokenizing 4000 rows took {elapsed:.1f}s"


# ---------------------------------------------------------------------------------------- packing


def _varied_rows(n: int) -> list[dict[str, object]]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "again", "and", "again"]
    return [
        chat(
            ("user", " ".join(words[: 2 + i % 7])), ("assistant", " ".join(words[i % 5 : i % 5 + 1 + i % 4]))
        )
        for i in range(n)
    ]


def test_packing_fills_rows_and_keeps_every_example_once(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    path = write_jsonl(_varied_rows(20))
    plain = load_dataset(path, tiny.tokenizer, 96)
    packed = load_dataset(path, tiny.tokenizer, 96, pack=True)
    assert len(packed) < len(plain)
    assert sorted(line for r in packed.rows for line in r.lines) == list(range(1, 21))
    assert all(len(r.input_ids) <= 96 for r in packed.rows)
    assert packed.tokens == plain.tokens and packed.trainable_tokens == plain.trainable_tokens
    by_line = {r.lines[0]: r for r in plain.rows}
    for r in packed.rows:
        # each packed example is its unpacked row verbatim, positions restarting at 0
        pos = 0
        for line in r.lines:
            n = len(by_line[line].input_ids)
            assert r.input_ids[pos : pos + n] == by_line[line].input_ids
            assert r.labels[pos : pos + n] == by_line[line].labels
            assert r.position_ids[pos : pos + n] == list(range(n))
            pos += n
    again = load_dataset(path, tiny.tokenizer, 96, pack=True)
    assert [r.lines for r in again.rows] == [r.lines for r in packed.rows]


def test_packed_per_token_loss_equals_examples_run_separately(
    tiny: LoadedModel, write_jsonl: WriteJsonl
) -> None:
    path = write_jsonl(_varied_rows(12))
    plain = load_dataset(path, tiny.tokenizer, 128)
    packed = load_dataset(path, tiny.tokenizer, 128, pack=True)
    assert any(len(r.lines) > 1 for r in packed.rows)
    separate = {
        r.lines[0]: per_token_loss(tiny.model, collate([r], plain.pad_token_id, packed=False))[0]
        for r in plain.rows
    }
    batch = collate(packed.rows, packed.pad_token_id, packed=True)  # padded rows, B > 1
    losses = per_token_loss(tiny.model, batch)
    for b, r in enumerate(packed.rows):
        pos = 0
        for line in r.lines:
            n = len(plain.rows[line - 1].input_ids)
            # position pos + t predicts token pos + t + 1; the example's first label is ignored, so the
            # loss at the boundary position (pos - 1) is 0 and never mixes examples
            got = losses[b, pos : pos + n - 1]
            assert torch.allclose(got, separate[line], atol=1e-5), (line, (got - separate[line]).abs().max())
            if pos > 0:
                assert losses[b, pos - 1] == 0
            pos += n
    # a packed run's mean loss is the mean over the same trainable tokens
    mask = batch.labels[:, 1:] != IGNORE_INDEX
    assert int(mask.sum()) == plain.trainable_tokens


# --------------------------------------------------------------------------------------- batching


def test_padding_does_not_change_real_tokens_loss(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    ds = load_dataset(write_jsonl(_varied_rows(4)), tiny.tokenizer, 128)
    batch = collate(ds.rows, ds.pad_token_id, packed=False, pad_to=128)
    assert batch.input_ids.shape == (4, 128)
    assert batch.num_tokens == ds.tokens and batch.num_trainable_tokens == ds.trainable_tokens
    losses = per_token_loss(tiny.model, batch)
    for b, r in enumerate(ds.rows):
        alone = per_token_loss(tiny.model, collate([r], ds.pad_token_id, packed=False))[0]
        n = len(r.input_ids)
        assert torch.allclose(losses[b, : n - 1], alone, atol=1e-5)
        assert (losses[b, n - 1 :] == 0).all()
        assert (batch.input_ids[b, n:] == ds.pad_token_id).all()
        assert (batch.attention_mask[b, n:] == 0).all() and (batch.attention_mask[b, :n] == 1).all()
    with pytest.raises(ValueError, match="pad_to=8 is shorter"):
        collate(ds.rows, ds.pad_token_id, packed=False, pad_to=8)


def test_batch_sampler_is_deterministic_and_resumable(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    ds = load_dataset(write_jsonl(_varied_rows(10)), tiny.tokenizer, 64)
    sampler = BatchSampler(ds, batch_size=3, seed=7)
    assert len(sampler) == 4  # 3 + 3 + 3 + 1
    full = [(e, i, b) for (e, i, b), _ in zip(sampler.iter_from(0, 0), range(8), strict=False)]
    assert [(e, i) for e, i, _ in full] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    # resuming at (epoch 1, batch 1) yields exactly what the uninterrupted run saw
    resumed = [b for (_, _, b), _ in zip(BatchSampler(ds, 3, seed=7).iter_from(1, 1), range(3), strict=False)]
    for got, (_, _, want) in zip(resumed, full[5:], strict=True):
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels)
    assert torch.equal(sampler.batch(1, 2).input_ids, full[6][2].input_ids)
    # each epoch is a permutation; epochs differ; another seed differs
    assert sorted(sampler.order(0)) == list(range(10)) and sampler.order(0) != sampler.order(1)
    assert BatchSampler(ds, 3, seed=8).order(0) != sampler.order(0)
    assert BatchSampler(ds, 3, seed=7, shuffle=False).order(0) == list(range(10))
    assert len(BatchSampler(ds, 3, seed=7, drop_last=True)) == 3
    fixed = BatchSampler(ds, 3, seed=7, pad_to=64).batch(0, 3)
    assert fixed.input_ids.shape == (1, 64)


def test_pack_examples_best_fit_decreasing() -> None:
    # lengths 40, 30, 24, 20, 10, 4 into rows of 64: 40+24 and 30+20+10+4 (two full rows)
    lengths = {1: 10, 2: 40, 3: 4, 4: 30, 5: 24, 6: 20}
    examples = [Example(line, [5] * n, [IGNORE_INDEX] + [5] * (n - 1)) for line, n in lengths.items()]
    rows = pack_examples(examples, 64)
    assert [r.lines for r in rows] == [[1, 3, 4, 6], [2, 5]]  # rows ordered by first line, lines in order
    assert [len(r.input_ids) for r in rows] == [64, 64]
    assert rows[1].position_ids == [*range(40), *range(24)]


def test_chat_rows_need_a_chat_template(tiny: LoadedModel, write_jsonl: WriteJsonl) -> None:
    tok = copy.deepcopy(tiny.tokenizer)
    tok.chat_template = None
    with pytest.raises(DatasetError, match="no chat template: use the prompt/completion or text format"):
        load_dataset(write_jsonl([chat(("user", "a"), ("assistant", "b"))]), tok, 64)
    assert load_dataset(write_jsonl([{"text": "plain text still works"}]), tok, 64).examples == 1


def _reference_packing(lengths: list[int], max_seq_len: int) -> list[list[int]]:
    """The rows (0-based example indices) of best-fit decreasing as first written here: a sorted
    list of (free tokens, row) tuples, one `insort` per example (quadratic, fine for a test)."""
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []
    for e in order:
        n = lengths[e]
        i = bisect.bisect_left(room, (n, -1))
        if i < len(room):
            free, b = room.pop(i)
            bins[b].append(e)
            bisect.insort(room, (free - n, b))
        else:
            bins.append([e])
            bisect.insort(room, (max_seq_len - n, len(bins) - 1))
    return sorted(sorted(members) for members in bins)


@pytest.mark.parametrize("max_seq_len", [64, 512])
def test_packing_places_examples_as_the_reference_best_fit(max_seq_len: int) -> None:
    import random

    rng = random.Random(max_seq_len)
    lengths = [rng.choice([rng.randint(2, 12), rng.randint(2, max_seq_len)]) for _ in range(3000)]
    examples = Examples.of(
        Example(i + 1, [7] * n, [IGNORE_INDEX] + [7] * (n - 1)) for i, n in enumerate(lengths)
    )
    rows = pack_examples(examples, max_seq_len)
    assert [[line - 1 for line in rows[r].lines] for r in range(len(rows))] == _reference_packing(
        lengths, max_seq_len
    )
    assert rows.lengths().tolist() == [len(rows[r].input_ids) for r in range(len(rows))]
    assert rows.segments().tolist() == [len(rows[r].lines) for r in range(len(rows))]
    assert int(rows.trainable().sum()) == sum(n - 1 for n in lengths)


def test_packing_asks_should_stop_as_it_places_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine import data
    from worker.engine.types import StopRequested

    monkeypatch.setattr(data, "PACK_CHECK_EVERY", 10)
    examples = Examples.of(Example(i + 1, [7] * 5, [IGNORE_INDEX] + [7] * 4) for i in range(35))
    asked = 0

    def ask() -> bool:
        nonlocal asked
        asked += 1
        return False

    assert len(pack_examples(examples, 64, should_stop=ask)) == 3
    assert asked == 3  # before the 11th, 21st and 31st example
    with pytest.raises(StopRequested, match="packing"):
        pack_examples(examples, 64, should_stop=lambda: True)


def test_tokenized_examples_take_three_bytes_a_token_and_a_holdout_copies_none(
    tiny: LoadedModel, write_jsonl: WriteJsonl
) -> None:
    from worker.engine.data import split_holdout

    examples, report = read_examples(write_jsonl(_varied_rows(300)), tiny.tokenizer, 128)
    assert report.ok and len(examples) == 300
    # tiny-llama's 509 ids fit 16 bits: 2 bytes an id and 1 a loss flag; 16 bytes an example
    assert examples.nbytes == 3 * report.tokens + 16 * 300
    train, held = split_holdout(examples, 0.1, seed=5)
    assert (len(train), len(held)) == (270, 30)
    assert train.nbytes == 4 * 270 and held.nbytes == 4 * 30  # their positions, no tokens
    assert train.tokens + held.tokens == report.tokens
    assert sorted(e.line for e in [*train, *held]) == list(range(1, 301))
    assert held[0] == examples[held[0].line - 1]
