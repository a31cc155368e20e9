"""tiny-llama: a random-init Llama of 0.14M parameters with a real byte-level BPE tokenizer.

Everything is built offline and deterministically: the tokenizer is trained on `tiny_corpus.txt`
(shipped next to this file) and the weights come from a fixed seed on the CPU in fp32, so every
machine gets bit-identical weights and token ids.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from worker.engine.catalog import TINY_LLAMA_SHAPE
from worker.engine.token_count import TINY_CHAT_TEMPLATE, TINY_EOS, train_tiny_tokenizer

TINY_SEED = 1234


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with TINY_LLAMA_SHAPE.vocab_size tokens (256 bytes + 4 specials + merges)."""
    tok = train_tiny_tokenizer()  # shared with the API's torch-free token counter (token_count.py)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=TINY_EOS,
        pad_token="<|pad|>",
        unk_token=None,
        bos_token=None,
        model_max_length=TINY_LLAMA_SHAPE.max_position_embeddings,
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>"]})
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        **TINY_LLAMA_SHAPE.config_kwargs(),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_llama() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """The model in fp32 on the CPU; callers move it (`.to(device, dtype)`) afterwards."""
    tokenizer = build_tiny_tokenizer()
    if len(tokenizer) > TINY_LLAMA_SHAPE.vocab_size:
        raise RuntimeError(
            f"tiny tokenizer has {len(tokenizer)} tokens > vocab {TINY_LLAMA_SHAPE.vocab_size}"
        )
    config = tiny_config(tokenizer)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.eval()
    return model, tokenizer
