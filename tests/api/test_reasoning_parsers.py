"""Reasoning parsers (jaxserve.api.reasoning_parsers) on hand-written outputs: whole-text
extract(), and the same text streamed in random chunks (1-character chunks included)
adding up to exactly extract()'s result. Pure Python: no jax, no server."""
from __future__ import annotations

import random

import pytest

from jaxserve.api.reasoning_parsers import (REASONING_PARSERS, ReasoningParser,
                                            get_reasoning_parser)

SEEDS = [0, 1, 2, 3, 4, 5]           # seed 0: one character at a time
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
       "</function>\n</tool_call>"

# (parser, prompt_ends_in_reasoning, id, output, expected (reasoning, content))
CASES = [
    ("qwen3", False, "think-block",
     "<think>\nThe user wants the capital of France. That is Paris.\n</think>\n\n"
     "The capital of France is **Paris**.",
     ("\nThe user wants the capital of France. That is Paris.\n",
      "\n\nThe capital of France is **Paris**.")),
    ("qwen3", False, "no-tags-all-content", "Just an answer, no thinking: 2 < 3 and 5 > 4.",
     (None, "Just an answer, no thinking: 2 < 3 and 5 > 4.")),
    ("qwen3", False, "leading-whitespace-then-think", "\n<think>Hmm.</think>Yes.",
     ("Hmm.", "Yes.")),
    ("qwen3", False, "unclosed-think-is-reasoning", "<think>\nLet me count: 1, 2, 3",
     ("\nLet me count: 1, 2, 3", None)),
    ("qwen3", False, "empty-think-block", "<think>\n\n</think>\n\nHello!",
     ("\n\n", "\n\nHello!")),
    ("qwen3", False, "unopened-end-tag-dropped", "Answer part one</think> and two.",
     (None, "Answer part one and two.")),
    ("qwen3", False, "think-not-at-start-is-text", "Use the <think> tag for thoughts.",
     (None, "Use the <think> tag for thoughts.")),
    ("qwen3", True, "prompt-opened-block",
     "Okay, the user asks about Zürich's weather. I should call the tool.\n</think>\n\n"
     "Let me check that.",
     ("Okay, the user asks about Zürich's weather. I should call the tool.\n",
      "\n\nLet me check that.")),
    ("qwen3", True, "cut-by-max-tokens", "Considering 東京 and the time zone, the",
     ("Considering 東京 and the time zone, the", None)),
    ("qwen3", True, "model-repeats-open-tag", "<think>\nx = 2</think>y",
     ("\nx = 2", "y")),
    ("qwen3", True, "later-end-tags-are-content", "a</think>b</think>c",
     ("a", "b</think>c")),
    ("qwen3", True, "tool-call-ends-reasoning", "I need the weather for Paris.\n" + CALL,
     ("I need the weather for Paris.\n", CALL)),
    ("qwen3", True, "tool-call-mention-stays-reasoning",
     "The <tool_call> tag wraps calls; <tool_call>\nnot here.\n</think>\n\nDone.",
     ("The <tool_call> tag wraps calls; <tool_call>\nnot here.\n", "\n\nDone.")),
    ("qwen3", True, "tool-call-after-end", "Think.</think>\n\n" + CALL,
     ("Think.", "\n\n" + CALL)),
    ("deepseek_r1", False, "r1-no-open-tag",
     "Okay, so 17 × 3: 17 × 3 = 51.\n</think>\n\n**51**",
     ("Okay, so 17 × 3: 17 × 3 = 51.\n", "\n\n**51**")),
    ("deepseek_r1", False, "r1-with-open-tag", "<think>\nHmm {x}.\n</think>\n\nDone.",
     ("\nHmm {x}.\n", "\n\nDone.")),
    ("deepseek_r1", True, "r1-no-end-all-reasoning", "Let me think about <b>this</b>",
     ("Let me think about <b>this</b>", None)),
    ("deepseek_r1", False, "r1-tool-call-not-special", "a <tool_call>\n<function=f></think>b",
     ("a <tool_call>\n<function=f>", "b")),
    ("deepseek_r1", False, "r1-empty", "", (None, None)),
]


def stream(parser: ReasoningParser, text: str, seed: int) -> tuple[str, str]:
    rnd = random.Random(seed)
    reasoning, content = [], []
    i = 0
    while i < len(text):
        n = 1 if seed == 0 else rnd.randint(1, 12)
        r, c = parser.feed(text[i:i + n])
        reasoning.append(r)
        content.append(c)
        i += n
    r, c = parser.finish()
    return "".join(reasoning + [r]), "".join(content + [c])


def _ids(cases: list) -> list[str]:
    return [f"{c[0]}:{c[2]}" for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_extract(case: tuple) -> None:
    name, opened, _, text, expected = case
    assert get_reasoning_parser(name)(prompt_ends_in_reasoning=opened).extract(text) == expected


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_stream_equals_extract(case: tuple, seed: int) -> None:
    name, opened, _, text, expected = case
    cls = get_reasoning_parser(name)
    reasoning, content = stream(cls(prompt_ends_in_reasoning=opened), text, seed)
    assert (reasoning or None, content or None) == expected


def test_stream_holds_only_possible_tags() -> None:
    """Reasoning flows while it is generated; only a possible tag start waits."""
    parser = get_reasoning_parser("qwen3")(prompt_ends_in_reasoning=True)
    assert parser.feed("Step one. </th") == ("Step one. ", "")
    assert parser.feed("ink>\n\nAns") == ("", "\n\nAns")
    parser = get_reasoning_parser("qwen3")()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>Plan") == ("Plan", "")
    assert parser.feed(" <tool_call>\n") == (" ", "")
    assert parser.feed("<function=f>") == ("", "<tool_call>\n<function=f>")


def test_extract_leaves_stream_state_alone() -> None:
    parser = get_reasoning_parser("deepseek_r1")()
    assert parser.feed("abc") == ("abc", "")
    assert parser.extract("x</think>y") == ("x", "y")
    assert parser.feed("</think>z") == ("", "z")


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    for name, cls in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is cls and cls.name == name
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("granite")
