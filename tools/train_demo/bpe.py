"""Byte-level BPE tokenizer for the demo model: Qwen's pre-tokenizer split and NFC normaliser,
learned merges, and the Qwen special tokens appended after the learned vocabulary (as Qwen
checkpoints place them), so the vocabulary is exactly `vocab_size` ids."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# Control tokens: never produced by normal text, skipped when decoding with skip_special_tokens.
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Markup tokens: single ids, but decoded as text (the chat parsers read them).
MARKUP_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
SPECIAL_TOKENS = CONTROL_TOKENS + MARKUP_TOKENS

# Contractions, letter runs with one leading non-letter, single digits, punctuation runs,
# newline runs and other whitespace: the split Qwen's tokenizers use.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def new_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def token_byte_lengths(tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """UTF-8 bytes each id stands for (byte-level tokens map one character to one byte), for
    bits-per-byte."""
    lengths = [0] * vocab_size
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            lengths[index] = len(token.encode()) if token in SPECIAL_TOKENS else len(token)
    return lengths
