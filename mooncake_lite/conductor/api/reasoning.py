"""A thinking model's reasoning, split from its answer (``--reasoning-parser think``).

Qwen3 and the DeepSeek-R1 distills write their reasoning first, between ``<think>`` and
``</think>``, then the answer; OpenAI-style clients expect the two apart (``reasoning_content``
beside ``content``, as vLLM and SGLang send them). The opening tag is either the model's own
first output (Qwen3) or already in the prompt the chat template rendered (R1 distills end their
generation prompt with it): then the output starts inside the reasoning.

Text arrives in deltas that may cut a tag anywhere, so what could still become a tag is held
back, as stop strings are (``text.TextStream``); ``flush`` at the end releases it as what it
turned out to be. Pure string work: no tokenizer, no IO.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered chat prompt ends inside an opened reasoning block (an R1-style template
    put ``<think>`` after the generation prompt, so the model's output starts with its thinking)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (what the next
    delta could complete into the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """``feed(delta) -> (reasoning, content)`` deltas; ``flush()`` the same at the end."""

    def __init__(self, opened: bool = False) -> None:
        self.opened = opened              # the prompt opened the block: the answer starts inside it
        self.state = "start"              # the first non-blank text decides
        self.held = ""                    # text that may still turn out to be (part of) a tag
        self._after_tag = False           # newlines right after a tag belong to neither part

    def feed(self, delta: str) -> tuple[str, str]:
        self.held += delta
        reasoning, content = "", ""
        if self.state == "start":
            begun = self.held.lstrip()
            if begun.startswith(OPEN):    # the model's own tag (an R1 distill may repeat the prompt's)
                self.held, self.state, self._after_tag = begun[len(OPEN):], "reasoning", True
            elif OPEN.startswith(begun):
                return "", ""             # blank so far, or a beginning of "<think>"
            elif self.opened:
                self.state, self._after_tag = "reasoning", True
            else:
                self.state = "content"    # no reasoning in this answer
        if self.state == "reasoning":
            self._skip_newlines()
            end = self.held.find(CLOSE)
            if end < 0:
                keep = _tag_prefix_at_end(self.held, CLOSE)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(CLOSE):]
            self.state, self._after_tag = "content", True
        self._skip_newlines()
        content, self.held = self.held, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The end of the output: held text is what it is (an unfinished reasoning stays reasoning,
        as vLLM's R1 parser has it; its Qwen3 parser would call it content)."""
        held, self.held = self.held, ""
        inside = self.state == "reasoning" or (self.state == "start" and self.opened)
        return (held, "") if inside else ("", held)

    def _skip_newlines(self) -> None:
        if self._after_tag:
            self.held = self.held.lstrip("\n")
            self._after_tag = not self.held   # until some text follows the tag


def split_whole(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole answer's (reasoning, None where there is none or it is empty; content)."""
    splitter = ThinkSplitter(opened)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.flush()
    return (r1 + r2) or None, c1 + c2
