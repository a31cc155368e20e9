"""Serving (worker/engine/serving.py) against transformers + PEFT, on the CPU.

Adapters here are made the way jobs make them (our LoRA layers, PEFT key names) with random
non-zero B factors, so an adapter changes the output. The oracle is `PeftModel.generate` on a
fresh copy of the same base with the same adapter files, greedy.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import GenerationMixin, PreTrainedModel

from worker.engine.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config
from worker.engine.lora import apply_lora, lora_modules, lora_state_dict
from worker.engine.models import LoadedModel
from worker.engine.serving import Adapter, DecodeBatch, GenRequest, ServingModel, TextStream
from worker.engine.types import LoraConfig, RequestError

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer like a pirate."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "How many legs does a spider have? Tell me in words please."}],
]


def make_adapter(
    tiny: LoadedModel, directory: Path, *, seed: int, cfg: LoraConfig, b_std: float = 0.5
) -> Adapter:
    """An adapter of `tiny` (any loaded base) with random A and B written in PEFT's layout;
    returns it as served."""
    model = copy.deepcopy(tiny.model)
    apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * b_std)
    directory.mkdir(parents=True)
    tensors = lora_state_dict(model)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    config = adapter_config(model, cfg, tiny.name)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config))
    return Adapter(config=config, tensors=tensors)


def peft_greedy(tiny: LoadedModel, adapter_dir: Path | None, prompt_ids: list[int], n: int) -> list[int]:
    """Token ids transformers (+ PEFT) generates greedily, EOS excluded."""
    model: PreTrainedModel | PeftModel = copy.deepcopy(tiny.model)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    # transformers 5's PreTrainedModel has no generate: the causal LMs (GenerationMixin) have
    assert isinstance(model, GenerationMixin | PeftModel)
    out = model.generate(
        input_ids=torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=tiny.tokenizer.eos_token_id,
        pad_token_id=tiny.tokenizer.pad_token_id,
    )
    new = out[0, len(prompt_ids) :].tolist()
    eos = tiny.tokenizer.eos_token_id
    return new[: new.index(eos)] if eos in new else new


@pytest.fixture(scope="module", params=["kv", "transformers"])
def served(tiny: LoadedModel, request: pytest.FixtureRequest) -> ServingModel:
    """Both engines: our KV cache (what Llama-shaped bases run) and transformers' forward over a
    DynamicCache (what other architectures run)."""
    model = ServingModel(LoadedModel(copy.deepcopy(tiny.model), tiny.tokenizer, "tiny-llama", True), 2)
    assert model.decoder is not None  # tiny-llama is Llama-shaped
    if request.param == "transformers":
        model.decoder = None
    return model


def test_mixed_adapter_batch_equals_peft_for_each_row(
    tiny: LoadedModel, served: ServingModel, tmp_path: Path
) -> None:
    a1 = make_adapter(tiny, tmp_path / "a1", seed=1, cfg=LoraConfig(r=4, alpha=8))
    # another rank, rsLoRA and only attention layers: the stacks pad ranks and skip layers
    a2 = make_adapter(
        tiny, tmp_path / "a2", seed=2, cfg=LoraConfig(r=12, alpha=6, target_modules=["q_proj", "v_proj"],
                                                        use_rslora=True),
    )  # fmt: skip
    s1 = served.adapter_slot("a1", lambda: a1)
    s2 = served.adapter_slot("a2", lambda: a2)
    rows = [(s1, "a1", 0), (0, None, 1), (s2, "a2", 2), (s1, "a1", 2), (s2, "a2", 0)]
    requests = []
    for slot, _, p in rows:
        requests.append(GenRequest(served.prompt_ids(PROMPTS[p]), max_tokens=12, slot=slot, temperature=0))
    streamed: dict[int, str] = {}
    results = served.generate(requests, lambda i, d: streamed.__setitem__(i, streamed.get(i, "") + d))

    outputs = set()
    for (_, name, p), req, res in zip(rows, requests, results, strict=True):
        expected = peft_greedy(tiny, tmp_path / name if name else None, req.prompt_ids, 12)
        assert res.text == tiny.tokenizer.decode(expected, skip_special_tokens=True), (name, p)
        assert res.completion_tokens == len(expected)
        assert res.finish_reason == ("length" if len(expected) == 12 else "stop")
        outputs.add(res.text)
    assert streamed == {i: r.text for i, r in enumerate(results)}  # the deltas add up to the text
    assert len(outputs) >= 4  # adapters change the answers (the comparison above is not vacuous)


def test_adapter_lru_evicts_the_least_recently_used(tiny: LoadedModel, tmp_path: Path) -> None:
    served = ServingModel(LoadedModel(copy.deepcopy(tiny.model), tiny.tokenizer, "tiny-llama", True), 2)
    adapters = {k: make_adapter(tiny, tmp_path / k, seed=i, cfg=LoraConfig(r=2)) for i, k in enumerate("xyz")}
    loads: list[str] = []

    def loader(k: str) -> Callable[[], Adapter]:
        def load() -> Adapter:
            loads.append(k)
            return adapters[k]

        return load

    sx = served.adapter_slot("x", loader("x"))
    served.adapter_slot("y", loader("y"))
    assert served.adapter_slot("x", loader("x")) == sx  # cached, now the most recent
    served.adapter_slot("z", loader("z"))  # evicts y
    assert served.loaded_adapters == ["x", "z"] and loads == ["x", "y", "z"]
    with pytest.raises(RuntimeError, match="in use"):
        served.adapter_slot("y", loader("y"), keep={1, 2})


def test_an_adapter_for_another_model_is_refused(tiny: LoadedModel, served: ServingModel) -> None:
    bad = Adapter(
        config={"r": 2, "lora_alpha": 4},
        tensors={
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 999),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2),
        },
    )
    with pytest.raises(RequestError, match="do not fit"):
        served.adapter_slot("bad", lambda: bad)
    with pytest.raises(RequestError, match="unknown layers"):
        served.adapter_slot("bad2", lambda: Adapter(config={"r": 1, "lora_alpha": 1}, tensors={
            "base_model.model.vision.proj.lora_A.weight": torch.zeros(1, 1),
            "base_model.model.vision.proj.lora_B.weight": torch.zeros(1, 1)}))  # fmt: skip
    assert "bad" not in served.loaded_adapters


def test_prompt_longer_than_the_context_names_messages(served: ServingModel) -> None:
    ids = served.prompt_ids(PROMPTS[0])
    with pytest.raises(RequestError) as err:
        served.generate([GenRequest(ids, max_tokens=served.max_context)])
    assert err.value.param == "messages" and "maximum context length" in str(err.value)


def test_seeded_sampling_is_reproducible_and_top_p_tiny_is_greedy(served: ServingModel) -> None:
    ids = served.prompt_ids(PROMPTS[1])
    a = served.generate([GenRequest(ids, 10, temperature=1.5, seed=5), GenRequest(ids, 10, temperature=1.5)])
    b = served.generate([GenRequest(ids, 10, temperature=1.5, seed=5)])
    assert a[0].text == b[0].text
    greedy = served.generate([GenRequest(ids, 10, temperature=0)])
    nucleus = served.generate([GenRequest(ids, 10, temperature=1.0, top_p=1e-6, seed=1)])
    assert nucleus[0].text == greedy[0].text


def test_stop_strings_cut_the_text_and_are_never_streamed(served: ServingModel) -> None:
    ids = served.prompt_ids(PROMPTS[2])
    full = served.generate([GenRequest(ids, 16, temperature=0)])[0].text
    assert len(full) > 6
    stop = full[3:6]
    deltas: list[str] = []
    cut = served.generate([GenRequest(ids, 16, temperature=0, stop=[stop])], lambda _i, d: deltas.append(d))[
        0
    ]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert "".join(deltas) == cut.text


class _EosIs:
    """The served tokenizer with another EOS id."""

    def __init__(self, tokenizer: object, eos: int) -> None:
        self._tokenizer, self.eos_token_id = tokenizer, eos

    def __getattr__(self, name: str) -> object:
        return getattr(self._tokenizer, name)


def test_ignore_eos_generates_max_tokens(served: ServingModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Benchmarks force every request to its full length: EOS is then an ordinary token."""
    ids = served.prompt_ids(PROMPTS[0])
    greedy = served.generate([GenRequest(ids, 12, temperature=0)])[0]
    batch = DecodeBatch()
    served.admit(batch, [(0, GenRequest(ids, 12, temperature=0))])
    assert batch.logits is not None
    first = int(batch.logits[0].argmax())  # made the EOS below: greedy decoding ends at once
    monkeypatch.setattr(served, "tokenizer", _EosIs(served.tokenizer, first))
    free = served.generate([GenRequest(ids, 12, temperature=0)])[0]
    forced = served.generate([GenRequest(ids, 12, temperature=0, ignore_eos=True)])[0]
    assert (free.completion_tokens, free.finish_reason) == (0, "stop")
    assert (forced.completion_tokens, forced.finish_reason) == (12, "length")
    assert forced.text == greedy.text


def test_text_stream_holds_back_partial_stop_strings(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    stream = TextStream(tok, ["END"])
    out = [stream.push(t) for t in tok("ab EN", add_special_tokens=False)["input_ids"]]
    assert "".join(out) == "ab " and stream.finish() == "EN"  # "EN" could have begun "END"


def test_requests_joining_a_running_batch_equal_peft_alone(
    tiny: LoadedModel, served: ServingModel, tmp_path: Path
) -> None:
    """Continuous batching: rows admitted while others are mid-decode (their caches merged,
    left-padded) still answer exactly what each answers alone."""
    adapter = make_adapter(tiny, tmp_path / "a", seed=5, cfg=LoraConfig(r=4, alpha=8))
    slot = served.adapter_slot("join-a", lambda: adapter)
    assert served.joins
    first = GenRequest(served.prompt_ids(PROMPTS[2]), max_tokens=14, slot=slot, temperature=0)
    later = [
        GenRequest(served.prompt_ids(PROMPTS[0]), max_tokens=10, slot=0, temperature=0),
        GenRequest(served.prompt_ids(PROMPTS[1]), max_tokens=12, slot=slot, temperature=0),
    ]
    batch = DecodeBatch()
    served.admit(batch, [("first", first)])
    results = {}
    for _ in range(3):
        results.update(served.step(batch))
    assert len(batch.rows) == 1  # mid-decode
    served.admit(batch, [("b", later[0]), ("c", later[1])])
    assert len(batch.rows) == 3
    while batch.rows:
        results.update(served.step(batch))
    for key, req, name in (("first", first, "a"), ("b", later[0], None), ("c", later[1], "a")):
        expected = peft_greedy(tiny, tmp_path / name if name else None, req.prompt_ids, req.max_tokens)
        assert results[key].text == tiny.tokenizer.decode(expected, skip_special_tokens=True), key
        assert results[key].completion_tokens == len(expected)
