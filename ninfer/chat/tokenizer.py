"""The artifact's tokenizer: `tokenizers` over the stored tokenizer.json plus the special-token
facts from tokenizer_config.json and generation_config.json that the chat layer needs."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# Qwen markup tokens that are parsed out of the text stream (reasoning split, tool calls), so
# their text must reach the decoder even when a tokenizer marks them special.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# The named special tokens that transformers hands to every chat template.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_dict(data: bytes | str | dict | None) -> dict:
    if data is None:
        return {}
    if isinstance(data, dict):
        return data
    return json.loads(data)


class Tokenizer:
    """Encodes without adding specials (the chat template writes them) and decodes ids to text.

    `hidden_ids` are special added tokens (e.g. `<|im_end|>`) whose text never reaches the output;
    the Qwen markup tokens in `MARKUP_TOKENS` always decode to their text.
    """

    def __init__(
        self,
        tokenizer_json: bytes | str,
        tokenizer_config: bytes | str | dict | None = None,
        generation_config: bytes | str | dict | None = None,
    ) -> None:
        if isinstance(tokenizer_json, bytes):
            tokenizer_json = tokenizer_json.decode("utf-8")
        self._json = tokenizer_json
        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.config = _as_dict(tokenizer_config)
        self.generation_config = _as_dict(generation_config)

        added = self._tok.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.hidden_ids: frozenset[int] = frozenset(
            i for i in self.special_ids if added[i].content not in MARKUP_TOKENS
        )
        self.special_tokens: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            text = _token_text(self.config.get(name))
            if text is not None:
                self.special_tokens[name] = text

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The texts `encode` reads as hidden special tokens (`<|im_end|>`, ...): what a chat
        prompt must not take from a client's text (`encode_with_literals`)."""
        added = self._tok.get_added_tokens_decoder()
        return tuple(sorted(added[i].content for i in self.hidden_ids))

    @functools.cached_property
    def _special_split(self) -> re.Pattern:
        added = self._tok.get_added_tokens_decoder()
        texts = sorted((added[i].content for i in self.special_ids), key=len, reverse=True)
        return (
            re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else re.compile("$^")
        )

    @functools.cached_property
    def _as_text(self) -> HFTokenizer:
        """The same tokenizer reading special tokens' texts as text (a second instance: the
        switch is the instance's, and `encode` may run in other threads meanwhile)."""
        plain = HFTokenizer.from_str(self._json)
        plain.encode_special_tokens = True
        return plain

    def encode_with_literals(self, text: str, literals: Mapping[str, str]) -> list[int]:
        """`encode(text)` where each key of `literals` (a character, or its JSON escape) stands
        for its string, which is tokenized as the text it is even where it spells a special
        token. The text between special tokens is tokenized as one piece, as `encode` does (it
        splits at special tokens first), so a text without those keys gets `encode`'s ids."""
        if not any(mark in text for mark in literals):
            return self.encode(text)
        ids: list[int] = []
        for index, piece in enumerate(self._special_split.split(text)):
            if index % 2:  # a special token the text itself holds
                ids.append(self._tok.token_to_id(piece))
            elif piece:
                for mark, literal in literals.items():
                    piece = piece.replace(mark, literal)
                ids.extend(self._as_text.encode(piece, add_special_tokens=False).ids)
        return ids

    def decode(self, ids: Sequence[int], skip_hidden: bool = True) -> str:
        """Text of `ids`; hidden special tokens are dropped unless `skip_hidden` is False."""
        if skip_hidden:
            ids = [i for i in ids if i not in self.hidden_ids]
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Stop token ids: generation_config's `eos_token_id` (int or list), else the
        tokenizer_config `eos_token`."""
        value = self.generation_config.get("eos_token_id")
        ids: Iterable[int]
        if isinstance(value, int):
            ids = (value,)
        elif isinstance(value, list):
            ids = (int(v) for v in value)
        else:
            eos = self.special_tokens.get("eos_token")
            eos_id = self.token_to_id(eos) if eos is not None else None
            ids = () if eos_id is None else (eos_id,)
        return tuple(dict.fromkeys(ids))
