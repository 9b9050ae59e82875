"""The gateway's pure core: what a prepared request is (params.py makes them from bodies); token chunks -> the
client's bytes. No I/O here, so every rule is unit-testable without a mesh.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from hetmesh.protocol import ErrorInfo, SamplingParams, TokenChunk, Usage

from .schemas import invalid


class ApiError(Exception):
    """Ends a request with an OpenAI error; `info.status` is the HTTP status."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a reply becomes tool calls: `named` (the text is the arguments of `name`), or `required`
    (the text is a JSON array of {"name", "parameters"}): both forced by structured outputs; or `auto`
    (the model's own syntax, read by the model's tool-call parser, given `request`: the chat body)."""

    kind: str
    name: str = ""
    request: dict[str, Any] | None = None


# (reply text, the chat body) -> (content, tool calls), or None for a plain reply (gateway/toolcalls.py)
ToolParser = Callable[[str, dict[str, Any]], tuple[str | None, list[dict[str, Any]]] | None]


@dataclass(slots=True)
class Prepared:
    """One mesh request (one choice of the response) and how its reply is shaped."""

    prompt_tokens: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    index: int = 0  # the choice's index in the response
    echo: str = ""  # completions' echo: the prompt's text comes first
    tools: ToolMode | None = None
    counts_prompt: bool = True  # its prompt counts in the usage (n > 1 counts each prompt once)
    priority: int = 0  # vLLM's request priority (lower first in the engine's queue)
    extra: list[Prepared] = field(default_factory=list)  # the other choices (n > 1, a list of prompts)


def model_not_found(name: str) -> ErrorInfo:
    return invalid(f"The model `{name}` does not exist or you do not have access to it.", param="model",
                   code="model_not_found", status=404)


class Reassembler:
    """Puts one attempt's TokenChunks back in completion order and drops duplicates.

    A disaggregated request gets index 0 from the prefill worker and 1.. from the decode
    worker, on separate connections, so they may arrive out of order: later ones wait here.
    """

    __slots__ = ("done", "finish_reason", "next_index", "pending", "usage")

    def __init__(self) -> None:
        self.next_index = 0  # tokens delivered so far
        self.pending: dict[int, list[TokenChunk]] = {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.done = False

    def add(self, c: TokenChunk) -> list[TokenChunk]:
        """Chunks that became deliverable, in order (often just `c`)."""
        if self.done or c.index < self.next_index:
            return []
        if c.index > self.next_index:
            self.pending.setdefault(c.index, []).append(c)
            return []
        out: list[TokenChunk] = []
        self._take(c, out)
        while self.pending and not self.done:
            group = self.pending.pop(self.next_index, None)
            if group is None:
                break
            group.sort(key=lambda g: -len(g.token_ids))  # real tokens before a bare finish marker
            for g in group:
                if g.index == self.next_index and not self.done:
                    self._take(g, out)
        return out

    def _take(self, c: TokenChunk, out: list[TokenChunk]) -> None:
        if not c.token_ids and c.finish_reason is None:
            return  # an empty keep-alive chunk carries nothing
        out.append(c)
        self.next_index += len(c.token_ids)
        if c.usage is not None:
            self.usage = c.usage
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason
            self.done = True
            self.pending.clear()


def usage_of(r: Reassembler, prompt_len: int) -> Usage:
    if r.usage is not None:
        return r.usage
    return Usage(prompt_tokens=prompt_len, completion_tokens=r.next_index)


def usage_json(u: Usage) -> dict[str, object]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def client_finish_reason(reason: str | None) -> str | None:
    """Finish reasons OpenAI clients know; the mesh's own ones map onto them."""
    if reason in (None, "stop", "length", "content_filter", "tool_calls"):
        return reason
    return "stop"


_enc = msgspec.json.Encoder()


class Formatter:
    """Builds one choice's response bytes: SSE chunks in OpenAI's exact shapes, or the full JSON body.

    The constant head of every chunk is encoded once; per chunk only the text is escaped. Logprobs,
    echo and tool calls (from `prep`) take a slower path; `piece` turns a token id into its text.
    """

    __slots__ = ("buf", "chat", "created", "echo", "head", "id", "include_usage", "index", "lp", "model", "offset",
                 "parse", "piece", "plain", "tail", "tools")

    def __init__(self, chat: bool, completion_id: str, model: str, created: int, include_usage: bool,
                 prep: Prepared | None = None, piece: Callable[[int], str] | None = None,
                 parse: ToolParser | None = None) -> None:
        self.chat = chat
        self.id = completion_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.index = prep.index if prep is not None else 0
        self.lp = prep is not None and prep.sampling.logprobs is not None and piece is not None
        self.piece = piece or str
        self.echo = prep.echo if prep is not None else ""
        self.tools = prep.tools if prep is not None and chat else None
        self.parse = parse
        self.plain = not (self.lp or self.echo or self.tools)
        self.buf: list[str] = []  # tool calls: the text so far (they are sent whole, at the end)
        self.offset = 0  # completions' logprobs: text_offset of the next token
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = _enc.encode({"id": completion_id, "object": obj, "created": created, "model": model})
        self.head = head[:-1] + b',"system_fingerprint":null,"choices":[{"index":%d,' % self.index
        self.head = b"data: " + self.head
        self.tail = b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n"

    def sse(self, text: str, finish_reason: str | None, first: bool, logprobs: bytes = b"null") -> bytes:
        """OpenAI's chunk sequence for `text`: a chat stream opens with a role-only chunk (`first`), text
        goes in chunks without a finish reason, and the choice ends with a chunk of its own that carries
        the finish reason (an empty delta; a completion's empty text)."""
        out = b""
        if first and self.chat:
            out = self.head + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null' \
                + self.tail
        if text or logprobs != b"null":
            t = _enc.encode(text)
            body = b'"delta":{"content":' + t + b"}" if self.chat else b'"text":' + t
            out += self.head + body + b',"logprobs":' + logprobs + b',"finish_reason":null' + self.tail
        if finish_reason is not None:
            end = b'"delta":{}' if self.chat else b'"text":""'
            out += self.head + end + b',"logprobs":null,"finish_reason":' \
                + _enc.encode(client_finish_reason(finish_reason)) + self.tail
        return out

    def sse_chunks(self, chunks: list[TokenChunk], first: bool) -> bytes:
        """One write for every chunk that became deliverable together (fewer syscalls per token)."""
        if self.plain:
            if len(chunks) == 1:
                c = chunks[0]
                return self.sse(c.text, c.finish_reason, first)
            text = "".join(c.text for c in chunks)
            return self.sse(text, chunks[-1].finish_reason, first)
        text = "".join(c.text for c in chunks)
        fr = chunks[-1].finish_reason
        if self.tools is not None:
            return self._sse_tools(text, fr, first)
        if first:
            text = self.echo + text
        return self.sse(text, fr, first, _enc.encode(self._logprobs(chunks)) if self.lp else b"null")

    def _sse_tools(self, text: str, finish_reason: str | None, first: bool) -> bytes:
        """Tool calls are sent whole at the end: the role chunk first (no content: a reply to tools is
        mostly calls), then the calls (or the plain reply they turned out not to be) and the finish reason."""
        self.buf.append(text)
        out = b""
        if first:
            out = self.head + b'"delta":{"role":"assistant","content":null},"logprobs":null,"finish_reason":null' \
                + self.tail
        if finish_reason is None:
            return out
        whole = "".join(self.buf)
        calls, fr, content = self._tool_calls(whole, finish_reason)
        if calls is None:  # a plain reply, or not the JSON structured output promised (cut by max_tokens)
            return out + self.sse(whole, finish_reason, False)
        if content:
            out += self.sse(content, None, False)
        deltas = [{"index": i, **c} for i, c in enumerate(calls)]
        return (out + self.head + b'"delta":' + _enc.encode({"tool_calls": deltas})
                + b',"logprobs":null,"finish_reason":null' + self.tail + self.sse("", fr, False))

    def _tool_calls(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]] | None, str | None,
                                                                       str | None]:
        """The tool calls in the reply, the finish reason OpenAI gives them, and the text beside them."""
        tools = self.tools
        if tools is None:
            return None, finish_reason, None
        if tools.kind == "auto":
            got = self.parse(text, tools.request or {}) if self.parse is not None else None
            if got is None:
                return None, finish_reason, None
            return got[1], "tool_calls", got[0]
        if finish_reason == "length":
            return None, finish_reason, None
        try:
            value = json.loads(text)
        except ValueError:
            return None, finish_reason, None
        ident = self.id.replace("chatcmpl-", "call_", 1)
        if tools.kind == "named":
            if not isinstance(value, dict):
                return None, finish_reason, None
            return [{"id": f"{ident}_{self.index}_0", "type": "function",
                     "function": {"name": tools.name, "arguments": text.strip()}}], "stop", None
        if not isinstance(value, list) or not all(isinstance(v, dict) and "name" in v for v in value):
            return None, finish_reason, None
        return [{"id": f"{ident}_{self.index}_{i}", "type": "function",
                 "function": {"name": v["name"], "arguments": json.dumps(v.get("parameters", {}))}}
                for i, v in enumerate(value)], "tool_calls", None

    def _logprobs(self, chunks: list[TokenChunk]) -> dict[str, Any]:
        entries = [e for c in chunks for e in (c.logprobs or ())]
        piece = self.piece
        if self.chat:
            content = []
            for e in entries:
                s = piece(e.token_id)
                top = []
                for t, lp in e.top:
                    ts = piece(t)
                    top.append({"token": ts, "logprob": lp, "bytes": list(ts.encode())})
                content.append({"token": s, "logprob": e.logprob, "bytes": list(s.encode()), "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens: list[str] = []
        offsets: list[int] = []
        for e in entries:
            s = piece(e.token_id)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{piece(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    def sse_usage(self, u: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return b"data: " + _enc.encode({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                        "system_fingerprint": None, "choices": [], "usage": usage_json(u)}) + b"\n\n"

    def sse_end(self, usage: Callable[[], Usage]) -> bytes:
        """The stream's last events: the usage chunk if the client asked for it (include_usage), then [DONE]."""
        return (self.sse_usage(usage()) + DONE) if self.include_usage else DONE

    def choice(self, chunks: list[TokenChunk], finish_reason: str | None) -> dict[str, Any]:
        """This choice of a full (non-streamed) response."""
        text = "".join(c.text for c in chunks)
        fr = client_finish_reason(finish_reason)
        lp = self._logprobs(chunks) if self.lp else None
        if not self.chat:
            return {"index": self.index, "text": self.echo + text, "logprobs": lp, "finish_reason": fr}
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.tools is not None:
            calls, tfr, content = self._tool_calls(text, finish_reason)
            if calls is not None:
                message = {"role": "assistant", "content": content, "refusal": None, "tool_calls": calls}
                fr = tfr
        return {"index": self.index, "message": message, "logprobs": lp, "finish_reason": fr}

    def body(self, choices: list[dict[str, Any]], u: Usage) -> bytes:
        obj = "chat.completion" if self.chat else "text_completion"
        return _enc.encode({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                            "system_fingerprint": None, "choices": choices, "usage": usage_json(u)})

    def full_chunks(self, chunks: list[TokenChunk], finish_reason: str | None, u: Usage) -> bytes:
        return self.body([self.choice(chunks, finish_reason)], u)

    def full(self, text: str, finish_reason: str | None, u: Usage) -> bytes:
        return self.full_chunks([TokenChunk(request_id="", worker_id="", index=0, token_ids=[], text=text)],
                                finish_reason, u)


DONE = b"data: [DONE]\n\n"


def sse_error(info: ErrorInfo) -> bytes:
    return b"data: " + _enc.encode({"error": {"message": info.message, "type": info.type, "param": info.param,
                                              "code": info.code}}) + b"\n\n"
