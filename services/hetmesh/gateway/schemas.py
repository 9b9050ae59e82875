"""OpenAI request bodies as pydantic models, and OpenAI-shaped error bodies.

Strict scalar types: OpenAI rejects `"temperature": "0.5"` and `"max_tokens": true`, so do we.
Every parameter of OpenAI's chat and completions APIs is declared here, and so are the vLLM extensions
we honour; an unknown one is refused with OpenAI's own 400 ("Unrecognized request argument supplied"),
never dropped. Declared is not honoured: core.py refuses, naming it, what the model's engines cannot do.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from hetmesh.protocol import ErrorInfo

Num = Annotated[float, Strict()]  # ints pass, strings and bools do not
Penalty = Annotated[Num, Field(ge=-2.0, le=2.0)]


def _finite(v: Any) -> Any:
    """A free-form JSON value (a tool's schema, template arguments) without NaN or Infinity anywhere in it."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            raise PydanticCustomError("finite_number", "Input should be a finite number")
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return v


JsonObject = Annotated[dict[str, Any], AfterValidator(_finite)]


class _Body(BaseModel):
    # The JSON parser takes a bare NaN or Infinity (not JSON): no field keeps one (from_validation says why).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: StrictStr


class ToolCallFunction(_Body):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[TextPart | RefusalPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: StrictStr | None = None  # tool
    refusal: StrictStr | None = None  # assistant
    audio: dict[str, Any] | None = None  # assistant: refused (no audio)
    function_call: dict[str, Any] | None = None  # assistant, deprecated: refused

    @model_validator(mode="after")
    def _tool_reply(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("missing_tool_call_id", "Missing parameter 'tool_call_id': messages with "
                                                              "role 'tool' must have a 'tool_call_id'.")
        return self

    def text(self) -> str:
        """The text content; parts joined by newlines, as vLLM does for string-content templates."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None


class FunctionDef(_Body):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: StrictStr | None = None
    parameters: JsonObject | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(_Body):
    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Num, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Num, Field(ge=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[Num, Field(ge=-100.0, le=100.0)]] | None = None
    # vLLM's extensions (its SamplingParams); ignore_eos: benchmarks use it for fixed-length output
    ignore_eos: StrictBool = False
    top_k: StrictInt | None = None
    min_p: Annotated[Num, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[Num, Field(gt=0.0, le=2.0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_token_ids: list[StrictInt] | None = None
    priority: StrictInt = 0  # vLLM's request priority: lower is served first in the engine's queue

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # Accepted: no effect on generation in OpenAI either (metadata is kept only with store) or a routing hint
    # that prefix-aware placement already follows (prompt_cache_key).
    metadata: dict[StrictStr, StrictStr] | None = None
    store: StrictBool | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    service_tier: StrictStr | None = None
    modalities: list[StrictStr] | None = None
    prompt_cache_retention: StrictStr | None = None
    # Declared so that they are refused by name (core.py), not as unknown fields.
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    # vLLM's chat extensions
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: JsonObject | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    suffix: StrictStr | None = None


# --- errors ------------------------------------------------------------------------------

_enc = msgspec.json.Encoder()


def body_model(chat: bool) -> type[ChatCompletionRequest] | type[CompletionRequest]:
    """The body a completion route takes: /v1/chat/completions (chat) or /v1/completions."""
    return ChatCompletionRequest if chat else CompletionRequest


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


def _non_finite(x: object) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def from_validation(exc: ValidationError | list[dict[str, Any]]) -> ErrorInfo:
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    # A bare NaN or Infinity is not JSON (OpenAI refuses the body as such), whatever field it landed in.
    if any(e["type"] in ("json_invalid", "finite_number") or _non_finite(e.get("input")) for e in errors):
        return invalid(BAD_JSON)
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] == "body":  # FastAPI prefixes body errors with "body"
        loc = loc[1:]
    param = _param(loc)
    if first["type"] == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param=param,
                       code="unrecognized_argument")
    if first["type"] == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param=param)
    if first["type"] == "missing_tool_call_id":
        return invalid(first["msg"], param=f"{param}.tool_call_id")
    what = f"'{param}'" if param else "the request body"
    return invalid(f"Invalid value for {what}: {first['msg']}.", param=param)
