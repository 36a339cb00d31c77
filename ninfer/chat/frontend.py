"""`ChatFrontend`: the artifact's tokenizer, chat template and sampling presets in one object,
the text side of a request from messages to prompt ids and from generated ids to text."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ninfer.chat.decoder import OutputDecoder
from ninfer.chat.presets import SamplingFields, sampling_preset
from ninfer.chat.template import (
    ChatTemplate,
    ChatTemplateError,
    prompt_ends_in_reasoning,
    tool_arguments_as_objects,
)
from ninfer.chat.tokenizer import Tokenizer
from ninfer.errors import InvalidRequestError


@dataclass(slots=True, frozen=True)
class ChatPrompt:
    """A rendered request: its text and ids, whether generation starts inside `<think>`, the
    resolved thinking mode (the explicit switch, else on when the template has one or the prompt
    opens `<think>`) and the effort passed to the template."""

    text: str
    token_ids: list[int]
    starts_in_reasoning: bool
    enable_thinking: bool
    reasoning_effort: str | None


def _json(data: bytes | str | dict | None) -> dict:
    if data is None:
        return {}
    if isinstance(data, dict):
        return data
    return json.loads(data)


def _pick_templates(chat_template: bytes | str | None, tokenizer_config: dict) -> dict[str, str]:
    """Named template sources: the standalone resource wins over tokenizer_config's
    `chat_template`, which is a string or a list of `{name, template}`."""
    if chat_template is not None:
        if isinstance(chat_template, bytes):
            chat_template = chat_template.decode("utf-8")
        return {"default": chat_template}
    embedded = tokenizer_config.get("chat_template")
    if isinstance(embedded, str):
        return {"default": embedded}
    if isinstance(embedded, list):
        return {t["name"]: t["template"] for t in embedded if "name" in t and "template" in t}
    return {}


class ChatFrontend:
    def __init__(
        self,
        tokenizer_json: bytes | str,
        tokenizer_config: bytes | str | dict | None = None,
        chat_template: bytes | str | None = None,
        generation_config: bytes | str | dict | None = None,
    ) -> None:
        config = _json(tokenizer_config)
        self.generation_config = _json(generation_config)
        self.tokenizer = Tokenizer(tokenizer_json, config, self.generation_config)
        self._templates = {
            name: ChatTemplate(source, self.tokenizer.special_tokens)
            for name, source in _pick_templates(chat_template, config).items()
        }

    @classmethod
    def from_artifact(cls, artifact: Any, component: str = "text") -> ChatFrontend:
        """From a `.ninfer` artifact's resources (`tokenizer` is required)."""
        tokenizer_json = artifact.resource("tokenizer", component)
        if tokenizer_json is None:
            raise ChatTemplateError("the artifact has no tokenizer resource")
        return cls(
            tokenizer_json,
            artifact.resource("tokenizer_config", component),
            artifact.resource("chat_template", component),
            artifact.resource("generation_config", component),
        )

    @classmethod
    def from_directory(cls, path: str | Path) -> ChatFrontend:
        """From a Hugging Face checkpoint directory (tokenizer.json, tokenizer_config.json,
        chat_template.jinja, generation_config.json; all but the first optional)."""
        root = Path(path)

        def read(name: str) -> bytes | None:
            file = root / name
            return file.read_bytes() if file.is_file() else None

        tokenizer_json = read("tokenizer.json")
        if tokenizer_json is None:
            raise FileNotFoundError(root / "tokenizer.json")
        return cls(
            tokenizer_json,
            read("tokenizer_config.json"),
            read("chat_template.jinja"),
            read("generation_config.json"),
        )

    def template(self, tools: list | None = None) -> ChatTemplate:
        """The template transformers would pick: `tool_use` when tools are given and it exists,
        else `default`."""
        if tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        raise ChatTemplateError("the model has no chat template; send token ids instead")

    @property
    def has_template(self) -> bool:
        return bool(self._templates)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
        preserve_thinking: bool | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> ChatPrompt:
        """Checks the reasoning options against the template (typed `ChatTemplateOptionError`),
        renders and tokenizes. Tool-call arguments given as JSON strings are passed to the
        template as objects. `continue_final`: the last message is an assistant turn the reply
        continues (a prefill): the prompt ends right after its text, with no end of turn and
        no new turn."""
        template = self.template(tools)
        options = template.resolve_reasoning(enable_thinking, reasoning_effort)
        if continue_final:
            messages = _marked_final(messages)
        # the client's text is text: a special token's text in it is tokenized as such, never
        # as the token, so that no message or tool can end a turn or open one
        # (arguments decoded first: a JSON string may spell a special text in escapes)
        messages = tool_arguments_as_objects(messages)
        literals = _Literals(self.tokenizer.control_texts, (messages, tools))
        messages, tools = literals.hide(messages), literals.hide(tools)
        text = template.render(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt and not continue_final,
            enable_thinking=options.enable_thinking,
            reasoning_effort=options.reasoning_effort,
            preserve_thinking=preserve_thinking,
        )
        if continue_final:
            text = _up_to_mark(text)
        starts_in_reasoning = prompt_ends_in_reasoning(text)
        thinking = options.enable_thinking
        if continue_final:  # the reply goes on from the text: it thinks only inside a <think>
            thinking = starts_in_reasoning
        elif thinking is None:
            thinking = starts_in_reasoning or template.capabilities.thinking
        return ChatPrompt(
            text=literals.restore(text),
            token_ids=self.tokenizer.encode_with_literals(text, literals.marks),
            starts_in_reasoning=starts_in_reasoning,
            enable_thinking=thinking,
            reasoning_effort=options.reasoning_effort,
        )

    def decoder(
        self,
        starts_in_reasoning: bool,
        stop: Iterable[str] = (),
        reasoning_stop: Iterable[str] = (),
        stop_token_ids: Collection[int] | None = None,
        split_reasoning: bool = True,
    ) -> OutputDecoder:
        """An output decoder; stop token ids default to the model's eos ids."""
        return OutputDecoder(
            self.tokenizer,
            starts_in_reasoning=starts_in_reasoning,
            stop=stop,
            reasoning_stop=reasoning_stop,
            stop_token_ids=self.stop_token_ids if stop_token_ids is None else stop_token_ids,
            split_reasoning=split_reasoning,
        )

    def sampling_preset(self, thinking: bool) -> SamplingFields:
        return sampling_preset(self.generation_config, thinking)


class _Literals:
    """Stand-ins for special tokens' texts inside a request's strings: each text becomes one
    private-use character that the request does not hold, so the template renders it as any
    other character (or as JSON's escape of it) and the tokenizer puts the text back, as text
    (`Tokenizer.encode_with_literals`). A string's start that could end a special token's text
    (`|>`) and its end that could begin one (`<|im_end|`) are stood in for too: the template
    may write them beside its own text (`'<function=' + name + '>'`)."""

    FIRST = 0xF0000  # plane 15, private use
    _PRIVATE = re.compile("[\U000f0000-\U0010ffff]")
    _ESCAPED = re.compile(r"\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})", re.IGNORECASE)

    def __init__(self, texts: Iterable[str], request: Any) -> None:
        texts = sorted(set(texts), key=len, reverse=True)
        # one pass of C per string: the texts, then the seams (tuples to startswith/endswith)
        self._find = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._heads = tuple({t[i:] for t in texts for i in range(1, len(t))})
        self._tails = tuple({t[:i] for t in texts for i in range(1, len(t))})
        self.marks: dict[str, str] = {}  # stand-in (or its JSON escape) -> text
        self._by_text: dict[str, str] = {}
        if self._find is None:
            return
        strings = list(_strings(request))
        needed = sorted({piece for string in strings for piece in self._pieces(string)})
        if not needed:
            return
        taken = {ch for string in strings for ch in self._PRIVATE.findall(string)}
        for string in strings:  # stand-ins whose escapes a string already holds
            for high, low in self._ESCAPED.findall(string):
                taken.add(chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + int(low, 16) - 0xDC00))
        free = (chr(c) for c in range(self.FIRST, 0x10FFFE) if chr(c) not in taken)
        for text in needed:
            mark = next(free, None)
            if mark is None:
                raise InvalidRequestError(
                    "the request holds nearly every private-use character (U+F0000-U+10FFFD); "
                    "with them its special tokens' texts cannot be told from the template's"
                )
            self.marks[mark] = text
            # as a template's `tojson(ensure_ascii=True)` writes them
            self.marks[json.dumps(mark)[1:-1]] = json.dumps(text)[1:-1]
            self._by_text[text] = mark

    def _ends(self, string: str) -> tuple[str, str]:
        """(the first character of `string` where it starts with what ends a special text, the
        last where it ends with what begins one; empty where not). One stand-in at the seam is
        enough: no special text can then span it."""
        head = string[:1] if string.startswith(self._heads) else ""
        tail = string[-1:] if string.endswith(self._tails) else ""
        return head, tail

    def _pieces(self, string: str) -> Iterable[str]:
        """The texts a string needs stood in for: the special texts it holds, and its ends."""
        found = self._find.findall(string)
        if found:  # as `hide` leaves it: a character of no special text in each
            yield from found
            string = self._find.sub("\x00", string)
        yield from (piece for piece in self._ends(string) if piece)

    def hide(self, value: Any) -> Any:
        """`value` (messages, tools: mappings, lists, strings) with the texts replaced."""
        if not self.marks:
            return value
        if isinstance(value, str):
            value = self._find.sub(lambda match: self._by_text[match.group()], value)
            head, tail = self._ends(value)
            if len(value) == 1 and (head or tail):
                return self._by_text[value]
            if tail:
                value = value[:-1] + self._by_text[tail]
            if head:
                value = self._by_text[head] + value[1:]
            return value
        if isinstance(value, Mapping):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.hide(item) for item in value)
        return value

    def restore(self, text: str) -> str:
        for mark, literal in self.marks.items():
            text = text.replace(mark, literal)
        return text


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


# Appended to the final message's text to find where the template put its end (the marker
# transformers' `continue_final_message` uses: the same prompt wherever a template moves or
# trims the text).
FINAL_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


def _marked_final(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with FINAL_MARK after the final assistant message's text."""
    final = messages[-1] if messages else {}
    content = final.get("content")
    if final.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("only a final assistant message with text can be continued")
    return [*messages[:-1], {**final, "content": content + FINAL_MARK}]


def _up_to_mark(text: str) -> str:
    """The rendered conversation cut where FINAL_MARK stands last; where the template trimmed
    the text's trailing whitespace (the mark's own space gone too), cut before that as well."""
    mark = FINAL_MARK.strip()
    at = text.rfind(mark)
    if at < 0:
        raise ChatTemplateError("the template does not show the final assistant message's text")
    if text.startswith(FINAL_MARK, at):
        return text[:at]
    return text[:at].rstrip()
