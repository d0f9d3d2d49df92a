"""Reasoning parsers: split a model's `<think>...</think>` block from its answer.

Chosen by `--reasoning-parser NAME`, as in vLLM. A parser is one incremental state
machine: `feed()` runs it on what has arrived, `finish()` once more knowing the output is
complete, and `extract()` runs a fresh copy on a whole text in that final mode, so a
stream always adds up to exactly what `extract()` returns. Text is held back only while it
may be the start of a tag (a partial "</thi").

Both parsers strip a `<think>` that opens the output (after whitespace); a `<think>`
anywhere else is plain text. The reasoning and the content are returned as written,
newlines included; `extract()` gives None for an empty part.
"""
from __future__ import annotations

from typing import ClassVar

START, END = "<think>", "</think>"


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Base class. Phases: "start" (is there a leading <think>?), "reasoning", "content",
    and "plain" (content of an output that never reasoned)."""

    name: ClassVar[str] = ""

    def __init__(self, *, prompt_ends_in_reasoning: bool = False) -> None:
        self.prompt_ends_in_reasoning = prompt_ends_in_reasoning
        self._phase = "start"
        self._buf = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []

    # ---- public API -------------------------------------------------------------------
    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; this parser's state is kept."""
        fresh = type(self)(prompt_ends_in_reasoning=self.prompt_ends_in_reasoning)
        fresh._buf = text
        reasoning, content = fresh.finish()
        return reasoning or None, content or None

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of output."""
        self._buf += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> tuple[str, str]:
        """End of output: flush what was held back."""
        self._advance(final=True)
        return self._take()

    # ---- behaviour that differs between models ------------------------------------------
    def _first_phase(self) -> str:
        """Where an output without a leading <think> starts."""
        return "reasoning" if self.prompt_ends_in_reasoning else "plain"

    def _reasoning_end(self, buf: str, final: bool) -> tuple[int, int, int]:
        """(index where reasoning ends or -1, length of the tag to drop there, characters
        to hold back when it does not end in `buf`)."""
        i = buf.find(END)
        if i >= 0:
            return i, len(END), 0
        return -1, 0, 0 if final else _partial(buf, END)

    # ---- the state machine ---------------------------------------------------------------
    def _advance(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._phase == "start":
                head = buf.lstrip()
                if head.startswith(START):
                    self._buf, self._phase = head[len(START):], "reasoning"
                elif not final and START.startswith(head):
                    return
                else:
                    self._phase = self._first_phase()
            elif self._phase == "reasoning":
                i, skip, hold = self._reasoning_end(buf, final)
                if i >= 0:
                    self._reasoning.append(buf[:i])
                    self._buf, self._phase = buf[i + skip:], "content"
                    continue
                self._reasoning.append(buf[:len(buf) - hold])
                self._buf = buf[len(buf) - hold:]
                return
            elif self._phase == "plain":
                # A </think> that was never opened: a stream cannot take back the text it
                # already sent as content, so the tag is dropped and the text stays content.
                i = buf.find(END)
                if i >= 0:
                    self._content.append(buf[:i])
                    self._buf, self._phase = buf[i + len(END):], "content"
                    continue
                hold = 0 if final else _partial(buf, END)
                self._content.append(buf[:len(buf) - hold])
                self._buf = buf[len(buf) - hold:]
                return
            else:                                         # "content": everything after
                self._content.append(buf)
                self._buf = ""
                return

    def _take(self) -> tuple[str, str]:
        out = "".join(self._reasoning), "".join(self._content)
        self._reasoning.clear()
        self._content.clear()
        return out


class Qwen3ReasoningParser(ReasoningParser):
    """`qwen3`: Qwen3 / Qwen3.5 / Qwen3.6.

    Qwen3 (up to the 2507 releases) writes `<think>` itself; the Qwen3.5/3.6 templates put
    "<think>\\n" at the end of the prompt (pass prompt_ends_in_reasoning=True), so the
    output holds only `</think>`. Text before `</think>` is reasoning, after it content.
    No `</think>` at all: with prompt_ends_in_reasoning (or after a leading `<think>`) it
    is all reasoning (the output was cut, e.g. by max_tokens); without, all content (an
    unopened `</think>` is then dropped and the text around it stays content).

    As in vLLM, a `<tool_call>` followed by `<function=` inside the reasoning also ends it
    (Qwen3.5 sometimes calls a tool without closing the think block): the call and what
    follows are content. A `<tool_call>` not followed by `<function=` stays reasoning."""

    name = "qwen3"
    CALL, FUNCTION = "<tool_call>", "<function="

    def _reasoning_end(self, buf: str, final: bool) -> tuple[int, int, int]:
        end = buf.find(END)
        pos = 0
        while (j := buf.find(self.CALL, pos)) >= 0 and (end < 0 or j < end):
            rest = buf[j + len(self.CALL):].lstrip()
            if rest.startswith(self.FUNCTION):
                return j, 0, 0
            if not final and self.FUNCTION.startswith(rest):   # cannot tell yet
                return -1, 0, len(buf) - j
            pos = j + 1
        if end >= 0:
            return end, len(END), 0
        if final:
            return -1, 0, 0
        return -1, 0, max(_partial(buf, END), _partial(buf, self.CALL))


class DeepSeekR1ReasoningParser(ReasoningParser):
    """`deepseek_r1`: DeepSeek-R1 and its distills.

    The R1 templates open the think block in the prompt, so the output starts inside the
    reasoning whatever prompt_ends_in_reasoning says (as in vLLM): text before `</think>`
    is reasoning, after it content, and without `</think>` everything is reasoning. A
    leading `<think>` (older templates let the model write it) is stripped."""

    name = "deepseek_r1"

    def _first_phase(self) -> str:
        return "reasoning"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
