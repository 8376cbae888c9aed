"""Reasoning models: the text between `<think>` and `</think>` -> `reasoning_content` (chat) or a reasoning item
(responses), the rest -> content. Whole (`split_reasoning`) or while streaming (`ReasoningStream`).

Where the output begins depends on the rendered prompt, not the model alone:
- the template opened the block in the generation prompt (DeepSeek-R1, Qwen3 thinking models): the output
  starts inside reasoning and only holds the closing marker;
- the template wrote an empty block (Qwen3 with `enable_thinking: false`): the output is plain content;
- otherwise the model may open a block itself, at the very start of its reply (Qwen3's default).

A block is only read at the start of the reply: a `<think>` later in the content is text the model wrote
about tags, not reasoning. Models whose template and tokenizer name no markers get no splitter at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tfserve.protocol.tool_calls import partial_suffix


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    """The strings that open and close a reasoning block."""

    start: str
    end: str


THINK = ReasoningMarkers("<think>", "</think>")
# markers the detokenizer keeps in the text (a tokenizer's *special* tokens are skipped from it, so a model
# whose markers are special would need its text decoded with them; none we know of does this with <think>)
KNOWN_MARKERS = (THINK,)

START, REASONING, AFTER, CONTENT = "start", "reasoning", "after", "content"  # ReasoningStream's phases


def detect_markers(tokenizer: Any) -> ReasoningMarkers | None:
    """The reasoning markers of a model: named by its chat template (R1-style templates only name the closing
    one, to drop old reasoning from the history) or both added to its vocabulary. None: not a reasoning model."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (default, tool_use, ...)
        template = "\n".join(str(t) for t in template.values())
    added = getattr(tokenizer, "get_added_vocab", dict)()  # small: the added tokens only, not the whole vocab
    for markers in KNOWN_MARKERS:
        if markers.end in template or (markers.start in added and markers.end in added):
            return markers
    return None


def output_phase(prompt_text: str, markers: ReasoningMarkers) -> str:
    """Where the output begins, from the rendered prompt's tail: REASONING when the prompt ends with an unclosed
    opening marker, CONTENT when it ends with the closing one (the template wrote an empty block), else START
    (the model may open a block)."""
    tail = prompt_text.rstrip()
    if tail.endswith(markers.start):
        return REASONING
    if tail.endswith(markers.end):
        return CONTENT
    return START


def starts_in_reasoning(prompt_text: str, markers: ReasoningMarkers) -> bool:
    """True when the prompt ends with an unclosed opening marker: the output begins inside reasoning."""
    return output_phase(prompt_text, markers) == REASONING


def split_reasoning(text: str, markers: ReasoningMarkers = THINK, phase: str = START) -> tuple[str | None, str]:
    """A whole output -> (reasoning, or None when there is none; content). With no closing marker, everything
    after the opening one is reasoning (a reply cut by max_tokens while thinking)."""
    stream = ReasoningStream(markers, phase)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, content + more_content


@dataclass(frozen=True, slots=True)
class Reasoning:
    """How one request's output splits: the model's markers and the phase its output begins in."""

    markers: ReasoningMarkers
    phase: str

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.markers, self.phase)


def reasoning_for(tokenizer: Any, prompt_ids: list[int]) -> Reasoning | None:
    """The split of a request's output, from the model's markers and its rendered prompt; None for a model
    without reasoning markers (it pays nothing more)."""
    markers = detect_markers(tokenizer)
    if markers is None:
        return None
    # the tail is enough to see how the prompt ends; a marker can take one token per byte
    num_tail_tokens = 4 * max(len(markers.start), len(markers.end)) + 8
    tail = tokenizer.decode(prompt_ids[-num_tail_tokens:], skip_special_tokens=False)
    return Reasoning(markers, output_phase(tail, markers))


class ReasoningStream:
    """Feed text deltas, get back (reasoning delta, content delta) pairs; the reasoning always comes first.

    A possible marker split across deltas is held back until it is clearly one or not. The markers are not
    shown; whitespace around the reasoning and right after the closing marker is dropped. `num_reasoning_tokens`
    counts the tokens fed (with `num_tokens`) until the closing marker, that one's token included.
    """

    def __init__(self, markers: ReasoningMarkers = THINK, phase: str = START) -> None:
        self.markers = markers
        self.phase = phase
        self.num_reasoning_tokens = 0
        self.closed = False  # the closing marker was seen: the reasoning is whole
        self._buffer = ""  # text not yet handed out: a possible marker, or whitespace whose fate is open
        self._pending_space = ""  # whitespace at the end of the reasoning so far: dropped if the block ends
        self._started = False  # some reasoning text was handed out (leading whitespace is dropped)
        self._undecided_tokens = 0  # tokens fed at START that may yet turn out to open a block
        self._saw_block = phase == REASONING

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        """One delta (of `num_tokens` tokens) -> (reasoning text, content text) safe to hand out now."""
        before = self.phase
        if before == CONTENT:  # the common case once reasoning is over: pass straight through
            return "", text
        self._buffer += text
        reasoning, content = [], []
        while self._buffer and self._step(reasoning, content):
            pass
        self._count(before, num_tokens)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Whatever is still held: a partial marker is text of the phase it sits in."""
        reasoning, content = "", ""
        if self.phase == START:
            content = self._buffer
        elif self.phase == REASONING:
            reasoning = self._reasoning_text(self._buffer, final=True)
        self._buffer, self._pending_space = "", ""
        self.phase = CONTENT
        return reasoning, content

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume buffered text in the current phase; False when more text is needed."""
        markers, buffer = self.markers, self._buffer
        if self.phase == START:
            stripped = buffer.lstrip()
            if stripped.startswith(markers.start):
                self._buffer, self.phase, self._saw_block = stripped[len(markers.start):], REASONING, True
                return True
            if not stripped or markers.start.startswith(stripped):
                return False  # only whitespace, or the start of a marker, so far
            self.phase = CONTENT
            content.append(buffer)  # no block: the reply is content exactly as written
        elif self.phase == REASONING:
            end = buffer.find(markers.end)
            if end >= 0:
                reasoning.append(self._reasoning_text(buffer[:end], final=True))
                self._buffer, self._pending_space, self.phase = buffer[end + len(markers.end):], "", AFTER
                self.closed = True
                return True
            keep = partial_suffix(buffer, markers.end)
            reasoning.append(self._reasoning_text(buffer[: len(buffer) - keep]))
            self._buffer = buffer[len(buffer) - keep:]
            return False
        elif self.phase == AFTER:  # models write "\n\n" after the block: not content
            stripped = buffer.lstrip()
            if not stripped:
                self._buffer = ""
                return False
            self.phase = CONTENT
            content.append(stripped)
        else:
            content.append(buffer)
        self._buffer = ""
        return False

    def _reasoning_text(self, text: str, final: bool = False) -> str:
        if not self._started:
            text = text.lstrip()
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = "" if final else text[len(body):]
        self._started = self._started or bool(body)
        return body

    def _count(self, before: str, num_tokens: int) -> None:
        # token counts follow the phase each delta was fed in: exact for one token per delta (the usual step),
        # and free, where re-tokenizing the reasoning text would cost time and may not give the sampled tokens
        if before == REASONING:
            self.num_reasoning_tokens += num_tokens
        elif before == START:  # whitespace or a partial marker: reasoning only if a block opens after all
            self._undecided_tokens += num_tokens
            if self.phase != START:
                if self._saw_block:
                    self.num_reasoning_tokens += self._undecided_tokens
                self._undecided_tokens = 0
