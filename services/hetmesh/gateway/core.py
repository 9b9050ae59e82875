"""The gateway's pure core: request bodies -> prompt tokens and sampling; token chunks -> the
client's bytes. No I/O here, so every rule is unit-testable without a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from hetmesh.config import ModelConfig
from hetmesh.protocol import ErrorInfo, SamplingParams, TokenChunk, Usage
from hetmesh.tokenizer import Tokenizer, render_chat

from .schemas import ChatCompletionRequest, CompletionRequest, invalid

MAX_STOP = 4  # OpenAI's limit on stop sequences


class ApiError(Exception):
    """Ends a request with an OpenAI error; `info.status` is the HTTP status."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


@dataclass(slots=True)
class Prepared:
    prompt_tokens: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool


def model_not_found(name: str) -> ErrorInfo:
    return invalid(f"The model `{name}` does not exist or you do not have access to it.", param="model",
                   code="model_not_found", status=404)


def _common_checks(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.n is not None and body.n != 1:
        raise ApiError(invalid(f"Invalid value for 'n': only n=1 is supported, got {body.n}.", param="n"))
    stops = body.stops()
    if len(stops) > MAX_STOP:
        raise ApiError(invalid(f"Invalid value for 'stop': at most {MAX_STOP} stop sequences, got {len(stops)}.",
                               param="stop"))
    if any(s == "" for s in stops):
        raise ApiError(invalid("Invalid value for 'stop': stop sequences must not be empty.", param="stop"))
    if body.stream_options is not None and not body.stream:
        raise ApiError(invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                               param="stream_options"))


def _sampling(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, prompt_len: int,
              model: ModelConfig, prompt_param: str) -> SamplingParams:
    ctx = model.max_context
    if max_tokens is None:
        # Like vLLM: no limit given means "up to the end of the context".
        if prompt_len >= ctx:
            raise ApiError(invalid(
                f"This model's maximum context length is {ctx} tokens. However, your {prompt_param} resulted in "
                f"{prompt_len} tokens. Please reduce the length of the {prompt_param}.",
                param=prompt_param, code="context_length_exceeded"))
        max_tokens = ctx - prompt_len
    elif prompt_len + max_tokens > ctx:
        raise ApiError(invalid(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, {max_tokens} in the completion). "
            f"Please reduce the length of the {prompt_param} or completion.",
            param=prompt_param, code="context_length_exceeded"))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stops(),
        ignore_eos=body.ignore_eos,
    )


def _stream_flags(body: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    stream = bool(body.stream)
    return stream, stream and body.stream_options is not None and body.stream_options.include_usage


def prepare_chat(body: ChatCompletionRequest, model: ModelConfig, tok: Tokenizer) -> Prepared:
    _common_checks(body)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise ApiError(invalid("Set only one of 'max_tokens' and 'max_completion_tokens'.",
                               param="max_completion_tokens"))
    tokens = tok.encode(render_chat([(m.role, m.text()) for m in body.messages]))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    stream, usage = _stream_flags(body)
    return Prepared(tokens, _sampling(body, max_tokens, len(tokens), model, "messages"), stream, usage)


def prepare_completion(body: CompletionRequest, model: ModelConfig, tok: Tokenizer) -> Prepared:
    _common_checks(body)
    if body.best_of is not None and body.best_of != 1:
        raise ApiError(invalid("Invalid value for 'best_of': only best_of=1 is supported.", param="best_of"))
    if body.echo:
        raise ApiError(invalid("Invalid value for 'echo': echo is not supported.", param="echo"))
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], list | str):
        if len(p) != 1:
            raise ApiError(invalid("Invalid value for 'prompt': only one prompt per request is supported.",
                                   param="prompt"))
        p = p[0]
    if isinstance(p, str):
        tokens = tok.encode(p)
    else:
        tokens = list(p)  # type: ignore[arg-type]
        vocab = tok.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise ApiError(invalid(f"Invalid value for 'prompt': token ids must be in [0, {vocab}).",
                                   param="prompt"))
    if not tokens:
        raise ApiError(invalid("Invalid value for 'prompt': the prompt is empty.", param="prompt"))
    stream, usage = _stream_flags(body)
    return Prepared(tokens, _sampling(body, body.max_tokens, len(tokens), model, "prompt"), stream, usage)


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
    """Builds one request's response bytes: SSE chunks in OpenAI's exact shapes, or the full JSON body.

    The constant head of every chunk is encoded once; per chunk only the text is escaped.
    """

    __slots__ = ("chat", "created", "head", "id", "include_usage", "model", "tail")

    def __init__(self, chat: bool, completion_id: str, model: str, created: int, include_usage: bool) -> None:
        self.chat = chat
        self.id = completion_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = _enc.encode({"id": completion_id, "object": obj, "created": created, "model": model})
        self.head = b"data: " + head[:-1] + b',"system_fingerprint":null,"choices":[{"index":0,'
        self.tail = b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n"

    def sse(self, text: str, finish_reason: str | None, first: bool) -> bytes:
        fr = _enc.encode(client_finish_reason(finish_reason))
        t = _enc.encode(text)
        if self.chat:
            if first:
                delta = b'{"role":"assistant","content":' + t + b"}"
            elif text or finish_reason is None:
                delta = b'{"content":' + t + b"}"
            else:
                delta = b"{}"
            return self.head + b'"delta":' + delta + b',"logprobs":null,"finish_reason":' + fr + self.tail
        return self.head + b'"text":' + t + b',"logprobs":null,"finish_reason":' + fr + self.tail

    def sse_chunks(self, chunks: list[TokenChunk], first: bool) -> bytes:
        """One write for every chunk that became deliverable together (fewer syscalls per token)."""
        if len(chunks) == 1:
            c = chunks[0]
            return self.sse(c.text, c.finish_reason, first)
        text = "".join(c.text for c in chunks)
        return self.sse(text, chunks[-1].finish_reason, first)

    def sse_usage(self, u: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return b"data: " + _enc.encode({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                        "system_fingerprint": None, "choices": [], "usage": usage_json(u)}) + b"\n\n"

    def full(self, text: str, finish_reason: str | None, u: Usage) -> bytes:
        fr = client_finish_reason(finish_reason)
        if self.chat:
            choice: dict[str, object] = {"index": 0, "message": {"role": "assistant", "content": text,
                                                                 "refusal": None},
                                         "logprobs": None, "finish_reason": fr}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fr}
            obj = "text_completion"
        return _enc.encode({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                            "system_fingerprint": None, "choices": [choice], "usage": usage_json(u)})


DONE = b"data: [DONE]\n\n"


def sse_error(info: ErrorInfo) -> bytes:
    return b"data: " + _enc.encode({"error": {"message": info.message, "type": info.type, "param": info.param,
                                              "code": info.code}}) + b"\n\n"
