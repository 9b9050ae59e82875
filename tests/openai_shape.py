"""OpenAI's streamed chunk sequence, as the official client parses it, for the tests that check it:
a chat choice opens with a role-only chunk, its text comes in chunks without a finish reason, and it
ends with a chunk of an empty delta (a completion's: empty text) carrying the finish reason; with
`stream_options.include_usage` every chunk has `usage: null` and one last chunk has no choices and the
usage."""

from __future__ import annotations

from collections.abc import Sequence

from openai.types import Completion
from openai.types.chat import ChatCompletionChunk


def _usage_tail(chunks: Sequence[ChatCompletionChunk | Completion], usage: bool) -> list:
    assert chunks and len({c.id for c in chunks}) == 1
    if not usage:
        assert all(c.usage is None and c.choices for c in chunks)
        return list(chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.total_tokens > 0
    assert all(c.usage is None and c.choices for c in body)
    return body


def chat_text(chunks: Sequence[ChatCompletionChunk], finish: str | None = None, usage: bool = False) -> str:
    """The text of a one-choice chat stream whose chunks have OpenAI's shape (`finish`: the reason it must end with)."""
    body = _usage_tail(chunks, usage)
    assert all(c.object == "chat.completion.chunk" and len(c.choices) == 1 for c in body)
    first, *middle, last = (c.choices[0] for c in body)
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    assert all(c.delta.role is None and c.delta.content is not None and c.finish_reason is None for c in middle)
    d = last.delta
    assert (d.role, d.content, d.tool_calls) == (None, None, None) and last.finish_reason is not None
    assert finish is None or last.finish_reason == finish
    return "".join(c.delta.content or "" for c in middle)


def completion_text(chunks: Sequence[Completion], finish: str | None = None, usage: bool = False) -> str:
    """The text of a one-choice completions stream: text chunks, then an empty one with the finish reason."""
    body = _usage_tail(chunks, usage)
    assert all(c.object == "text_completion" and len(c.choices) == 1 for c in body)
    *texts, last = (c.choices[0] for c in body)
    assert all(c.text is not None and c.finish_reason is None for c in texts)
    assert last.text == "" and last.finish_reason is not None
    assert finish is None or last.finish_reason == finish
    return "".join(c.text for c in texts)
