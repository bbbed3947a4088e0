"""vLLM's `--reasoning-parser`: a thinking model's reasoning (`<think>…</think>`) kept apart from its answer.

Role: Qwen3-Omni-30B-A3B-Thinking writes its chain of thought, then `</think>`, then the answer (its chat template
opens `<think>` in the prompt; older templates let the model write it). With `--reasoning-parser qwen3` (or
`deepseek_r1`, the same markers) the chat API answers as vLLM's does: the thought in `message.reasoning`
(and `reasoning_content`, its former name, which DeepSeek-style clients read), the answer in `content`; streamed,
as `delta.reasoning` then `delta.content`. Tool calls are parsed from the answer only, and a structured output
shapes only the answer: the thinker starts the grammar once the text has passed the end marker
(`ChatRequest.reasoning_end`).

The rules (vLLM's `qwen3` parser): a leading `<think>` is dropped; the text up to the first `</think>` is
reasoning and the rest is the answer; with no `</think>` at all the whole text is reasoning (the thought was cut
off by max_tokens). A request with `chat_template_kwargs: {"enable_thinking": false}` (qwen3), or on a server
whose `--default-chat-template-kwargs` say so (`template_defaults`), does not think: all of its text is the
answer, as is one continuing an assistant message that already holds `</think>`.
`include_reasoning: false` (vLLM's request field) drops the reasoning.

Data flow: the thinker's text deltas -> `ReasoningStream.push` (holds back a tail that may be the start of a
marker, so the split never depends on how the text was cut into deltas) -> (reasoning, answer) pieces ->
`finish` at the end (`AnswerSplit`: one choice's, as the REST and gRPC fronts send it). A whole answer runs
through the same machine (`AnswerSplit.whole`), so streamed and whole answers agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def check_parser(name: str | None) -> str | None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return name


def _held_tail(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (kept until the next delta)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """One answer's split, delta by delta: `push` and `finish` return (reasoning, answer) text, either ''."""

    def __init__(self, thinking: bool) -> None:
        self.state = "lead" if thinking else "answer"  # lead: a `<think>` may still open the text
        self.held = ""

    def push(self, text: str) -> tuple[str, str]:
        if self.state == "answer":
            return "", text
        buf = self.held + text
        if self.state == "lead":
            body = buf.lstrip()
            if body.startswith(START):
                buf = body[len(START):]
            elif START.startswith(body):  # all of it may still be the opening marker (or blank so far)
                self.held = buf
                return "", ""
            self.state = "reasoning"
        end = buf.find(END)
        if end >= 0:
            self.state, self.held = "answer", ""
            return buf[:end], buf[end + len(END):]
        keep = _held_tail(buf, END)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The end of the text: whatever was held back is reasoning (no `</think>` came)."""
        held, self.held = self.held, ""
        return ("", "") if self.state == "answer" else (held, "")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    # --default-chat-template-kwargs: the variables under each request's own, as its template sees them
    template_defaults: dict[str, Any] = field(default_factory=dict, compare=False)

    def thinking(self, chat_template_kwargs: dict[str, Any]) -> bool:
        """Whether this request's answer starts with reasoning (qwen3: unless enable_thinking is false)."""
        variables = {**self.template_defaults, **chat_template_kwargs}
        return self.name != "qwen3" or variables.get("enable_thinking", True) is not False



class AnswerSplit:
    """One choice's text as a front end sends it: (reasoning to send, answer) per delta. Without a parser, or
    for a request that does not think, all of it is answer; `include=False` (vLLM's include_reasoning) sends no
    reasoning."""

    def __init__(self, parser: ReasoningParser | None, thinking: bool, include: bool = True) -> None:
        self.stream = ReasoningStream(thinking) if parser is not None else None
        self.include = include

    def push(self, text: str) -> tuple[str, str]:
        if self.stream is None:
            return "", text
        thought, answer = self.stream.push(text)
        return (thought if self.include else ""), answer

    def finish(self) -> tuple[str, str]:
        if self.stream is None:
            return "", ""
        thought, answer = self.stream.finish()
        return (thought if self.include else ""), answer

    def whole(self, text: str) -> tuple[str | None, str]:
        """A whole text -> (its reasoning, None when there is none to send; its answer)."""
        t1, a1 = self.push(text)
        t2, a2 = self.finish()
        return (t1 + t2) or None, a1 + a2


def thinks(parser: ReasoningParser | None, chat_template_kwargs: dict[str, Any], audio_out: bool,
           continued: str = "") -> bool:
    """Whether a request's answer starts with reasoning (a parser is on and the request thinks; `continued`: the
    assistant message it continues, whose `</think>` means the reasoning is already over). Speech then is a 400:
    the talker would speak the reasoning too."""
    if parser is None or not parser.thinking(chat_template_kwargs) or END in continued:
        return False
    if audio_out:
        from gateway.media import invalid_request

        raise invalid_request("modalities: this server splits the model's reasoning from its answer "
                              f"(--reasoning-parser {parser.name}) and the talker would speak the reasoning too; "
                              "ask for modalities [\"text\"], or send chat_template_kwargs {\"enable_thinking\": false}",
                              "modalities")
    return True


class ThoughtTokens:
    """An answer's split (`AnswerSplit`, its pieces returned as they are) that also counts the Responses API's
    `output_tokens_details.reasoning_tokens`: the tokens generated before the answer began (the thought and its
    end marker), read off the text deltas' token counts (`TextDelta.usage`). A delta that ends the thought and
    starts the answer (several tokens in one delta, `--stream-interval`) counts with the answer. A thought that
    never ended (cut off by max tokens) is every generated token."""

    def __init__(self, split: AnswerSplit) -> None:
        self.split = split
        self.tokens = 0
        self.answered = False

    def push(self, text: str, usage: tuple[int, int] | None) -> tuple[str, str]:
        """One delta's (reasoning, answer), as `AnswerSplit.push`."""
        thought, answer = self.split.push(text)
        if answer:
            self.answered = True
        elif not self.answered and usage is not None:
            self.tokens = usage[1]
        return thought, answer

    def finish(self) -> tuple[str, str]:
        return self.split.finish()

    @property
    def in_answer(self) -> bool:
        """The text now is the answer's (the answer began, or nothing reasons here)."""
        return self.answered or self.split.stream is None

    def total(self, completion_tokens: int) -> int:
        stream = self.split.stream
        if stream is None:
            return 0
        if not self.answered and stream.state != "answer":  # no end marker came: all of it was thought
            return completion_tokens
        return self.tokens
