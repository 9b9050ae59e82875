"""OpenAI request bodies as pydantic models, and OpenAI-shaped error bodies.

Strict scalar types: OpenAI rejects `"temperature": "0.5"` and `"max_tokens": true`, so do we.
Unknown fields are ignored (clients send many harmless ones: presence_penalty, logprobs, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, ValidationError

from hetmesh.protocol import ErrorInfo

Num = Annotated[float, Strict()]  # ints pass, strings and bools do not


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Common(_Body):
    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Num, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Num, Field(ge=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM's extension; benchmarks use it for fixed-length output

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    best_of: StrictInt | None = None
    echo: StrictBool = False


# --- errors ------------------------------------------------------------------------------

_enc = msgspec.json.Encoder()


def error_body(info: ErrorInfo) -> bytes:
    return _enc.encode({"error": {"message": info.message, "type": info.type, "param": info.param,
                                  "code": info.code}})


def invalid(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> ErrorInfo:
    return ErrorInfo(message=message, type="invalid_request_error", param=param, code=code, status=status)


BAD_JSON = ("We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
            "HTTP library correctly. The API expects a JSON payload, but what was sent was not valid JSON.)")


def _param(loc: tuple[int | str, ...]) -> str | None:
    """pydantic's location -> OpenAI's param: the top-level field, then list indexes and sub-fields.

    Union members show up in `loc` as type tags ('str', 'list[str]', ...); they are not fields.
    """
    if not loc:
        return None
    out = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in {"str", "int", "float", "bool", "list", "dict"}:
            out += f".{part}"
    return out


def from_validation(exc: ValidationError | list[dict[str, Any]]) -> ErrorInfo:
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        return invalid(BAD_JSON)
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] == "body":  # FastAPI prefixes body errors with "body"
        loc = loc[1:]
    param = _param(loc)
    if first["type"] == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param=param)
    what = f"'{param}'" if param else "the request body"
    return invalid(f"Invalid value for {what}: {first['msg']}.", param=param)
