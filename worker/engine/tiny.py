"""tiny-llama: a random-init Llama of 0.14M parameters with a real byte-level BPE tokenizer.

Everything is built offline and deterministically: the tokenizer is trained on `tiny_corpus.txt`
(shipped next to this file) and the weights come from a fixed seed on the CPU in fp32, so every
machine gets bit-identical weights and token ids.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from worker.engine.catalog import TINY_LLAMA_SHAPE

CORPUS = Path(__file__).with_name("tiny_corpus.txt")
TINY_SEED = 1234

# Ids 0..3, in this order (the trainer assigns special tokens first).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML; `add_generation_prompt` opens an assistant turn. Each turn ends with "<|im_end|>\n";
# the assistant's "<|im_end|>" is what it must learn to emit to stop.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with TINY_LLAMA_SHAPE.vocab_size tokens (256 bytes + 4 specials + merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_LLAMA_SHAPE.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        bos_token=None,
        model_max_length=TINY_LLAMA_SHAPE.max_position_embeddings,
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>"]})
    fast.chat_template = CHAT_TEMPLATE
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
