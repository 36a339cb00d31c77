"""Generated ids -> text, one token at a time: an incremental detokenizer that never splits a
UTF-8 character, the `<think>`/`</think>` split into reasoning and content, and stop strings on
either channel (matched across token boundaries, their text withheld)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from ninfer.chat.template import THINK_CLOSE, THINK_OPEN
from ninfer.chat.tokenizer import Tokenizer

REASONING = "reasoning"
CONTENT = "content"


class IncrementalDetokenizer:
    """Emits the text each new id completes.

    Decodes a short window `ids[prefix:]` and compares it with the window's already-emitted part
    `ids[prefix:read]`, so decoders that treat the first token specially (leading spaces) stay
    right. A window that ends in U+FFFD is an incomplete UTF-8 sequence: nothing is emitted until
    later ids complete it (or `flush` gives up at the end).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        if token_id in self._tokenizer.hidden_ids:
            return ""
        self._ids.append(token_id)
        emitted = self._tokenizer.decode(self._ids[self._prefix : self._read], skip_hidden=False)
        window = self._tokenizer.decode(self._ids[self._prefix :], skip_hidden=False)
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(emitted) :]

    def flush(self) -> str:
        """Whatever the last ids decode to, replacement characters included."""
        emitted = self._tokenizer.decode(self._ids[self._prefix : self._read], skip_hidden=False)
        window = self._tokenizer.decode(self._ids[self._prefix :], skip_hidden=False)
        self._prefix = self._read = len(self._ids)
        return window[len(emitted) :]


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class ThinkSplitter:
    """Routes text to the reasoning or the content channel.

    Reasoning runs until `</think>`. A `<think>` opens reasoning only at the very start of an
    output that began in content (leading whitespace allowed). Reasoning is trimmed at both ends
    and content loses the whitespace right after `</think>`, as Qwen templates render them
    (`<think>\\n...\\n</think>\\n\\n`). Text that could still be a marker (or whitespace that could
    be trimmed) is held back until it is decided.
    """

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.channel = REASONING if starts_in_reasoning else CONTENT
        self._buffer = ""
        self._segment_start = True  # nothing non-whitespace emitted on the current channel yet
        self._may_open = not starts_in_reasoning

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        out: list[tuple[str, str]] = []
        while self._buffer:
            if self.channel == REASONING:
                if not self._reasoning_step(out):
                    break
            elif not self._content_step(out):
                break
        return out

    def finish(self) -> list[tuple[str, str]]:
        text, self._buffer = self._buffer, ""
        if self.channel == REASONING:
            text = text.strip() if self._segment_start else text.rstrip()
        elif self._segment_start:
            text = text.lstrip()
        return [(self.channel, text)] if text else []

    def _reasoning_step(self, out: list[tuple[str, str]]) -> bool:
        buf = self._buffer
        if self._segment_start:
            buf = buf.lstrip()
            if not buf:
                self._buffer = ""
                return False
        end = buf.find(THINK_CLOSE)
        if end >= 0:
            self._emit(out, REASONING, buf[:end].rstrip())
            self._buffer = buf[end + len(THINK_CLOSE) :]
            self.channel, self._segment_start, self._may_open = CONTENT, True, False
            return True
        cut = len(buf) - partial_marker_length(buf, (THINK_CLOSE,))
        cut = len(buf[:cut].rstrip())
        self._emit(out, REASONING, buf[:cut])
        self._buffer = buf[cut:]
        return False

    def _content_step(self, out: list[tuple[str, str]]) -> bool:
        buf = self._buffer
        if self._segment_start:
            stripped = buf.lstrip()
            if self._may_open:
                if stripped.startswith(THINK_OPEN):
                    self._buffer = stripped[len(THINK_OPEN) :]
                    self.channel, self._segment_start, self._may_open = REASONING, True, False
                    return True
                if THINK_OPEN.startswith(stripped):
                    return False
            if not stripped:
                self._buffer = ""
                return False
            buf = stripped
        self._may_open = False
        self._emit(out, CONTENT, buf)
        self._buffer = ""
        return False

    def _emit(self, out: list[tuple[str, str]], channel: str, text: str) -> None:
        if text:
            out.append((channel, text))
            self._segment_start = False


class RawSplitter:
    """No reasoning split: every character goes to content as generated (`--raw-output`)."""

    channel = CONTENT

    def feed(self, text: str) -> list[tuple[str, str]]:
        return [(CONTENT, text)] if text else []

    def finish(self) -> list[tuple[str, str]]:
        return []


class StopMatcher:
    """Finds stop strings in a text stream split at arbitrary points; holds back any suffix that
    could begin a stop string."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, matched stop or None). On a match the text from the stop on is
        dropped."""
        if not self.stops:
            return text, None
        buf = self._held + text
        match: tuple[int, str] | None = None
        for stop in self.stops:
            at = buf.find(stop)
            if at >= 0 and (match is None or at < match[0]):
                match = (at, stop)
        if match is not None:
            self._held = ""
            return buf[: match[0]], match[1]
        keep = partial_marker_length(buf, self.stops)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


@dataclass(slots=True)
class DecodeStep:
    """New text on each channel after one token (or at the end). `stop` is the matched stop
    string or stop token id when `stopped`."""

    reasoning: str = ""
    content: str = ""
    stopped: bool = False
    stop: str | int | None = None


class OutputDecoder:
    """One request's output stream. `push` each generated id; once a step says `stopped` the
    request is over (the engine stops generating). `finish` flushes held text when the request
    ends for another reason (length, abort). Stop token ids yield no text but are counted."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        starts_in_reasoning: bool = False,
        stop: Iterable[str] = (),
        reasoning_stop: Iterable[str] = (),
        stop_token_ids: Collection[int] = (),
        split_reasoning: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._splitter: ThinkSplitter | RawSplitter = (
            ThinkSplitter(starts_in_reasoning) if split_reasoning else RawSplitter()
        )
        self._matchers = {CONTENT: StopMatcher(stop), REASONING: StopMatcher(reasoning_stop)}
        self._stop_token_ids = frozenset(stop_token_ids)
        self.stopped = False
        self.stop: str | int | None = None
        self.num_tokens = 0
        self.reasoning_tokens = 0

    @property
    def in_reasoning(self) -> bool:
        return self._splitter.channel == REASONING

    def push(self, token_id: int) -> DecodeStep:
        if self.stopped:
            raise RuntimeError("push after the output stopped")
        self.num_tokens += 1
        if self.in_reasoning:
            self.reasoning_tokens += 1
        step = DecodeStep()
        if token_id in self._stop_token_ids:
            self._drain(step)
            self._set_stopped(step, token_id)
            return step
        self._route(step, self._splitter.feed(self._detok.push(token_id)))
        return step

    def finish(self) -> DecodeStep:
        step = DecodeStep()
        if not self.stopped:
            self._drain(step)
        return step

    def _drain(self, step: DecodeStep) -> None:
        self._route(step, self._splitter.feed(self._detok.flush()))
        if not step.stopped:
            self._route(step, self._splitter.finish())
        if not step.stopped:
            step.reasoning += self._matchers[REASONING].flush()
            step.content += self._matchers[CONTENT].flush()

    def _route(self, step: DecodeStep, segments: list[tuple[str, str]]) -> None:
        for channel, text in segments:
            if channel == CONTENT:
                # Reasoning is closed, so a held partial reasoning stop can no longer complete.
                step.reasoning += self._matchers[REASONING].flush()
            emit, matched = self._matchers[channel].feed(text)
            if channel == CONTENT:
                step.content += emit
            else:
                step.reasoning += emit
            if matched is not None:
                self._set_stopped(step, matched)
                return

    def _set_stopped(self, step: DecodeStep, stop: str | int) -> None:
        step.stopped, step.stop = True, stop
        self.stopped, self.stop = True, stop
