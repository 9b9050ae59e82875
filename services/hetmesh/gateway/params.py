"""Request bodies -> what the mesh runs: every OpenAI parameter honoured or refused here, by name.

Pure: a validated body, the model, its tokenizer and what its engines can do (`Caps`) in; the
`Prepared` choices out, or an ApiError whose 400 names the parameter. `n > 1` and a list of prompts
fan out into one mesh request per choice (service.py runs them; choices.py merges the replies).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from hetmesh.config import ModelConfig
from hetmesh.protocol import SamplingParams, StructuredOutput
from hetmesh.tokenizer import Tokenizer

from .core import ApiError, Prepared, ToolMode
from .schemas import ChatCompletionRequest, CompletionRequest, invalid

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_CHOICES = 128  # n times the number of prompts: one mesh request each
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (and vLLM's default max_logprobs)

# Parameters of OpenAI's chat API that no engine here implements: refused by name when set.
REFUSED_CHAT = {
    "audio": "audio output",
    "functions": "the deprecated 'functions' (use 'tools')",
    "function_call": "the deprecated 'function_call' (use 'tool_choice')",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning effort (these models do not reason)",
    "verbosity": "verbosity",
    "web_search_options": "web search",
    "moderation": "moderation",
    "prompt_cache_options": "prompt cache options",
}


@dataclass(frozen=True, slots=True)
class Caps:
    """What every engine serving a model can do; what one of them cannot is refused for the model."""

    structured: bool = False  # constrained decoding: response_format json, forced tool calls
    logits: bool = False  # a real model's logits: top_k, min_p, repetition_penalty mean something
    tool_parser: bool = False  # tool_choice "auto": the gateway has the model's tool-call parser
    keeps_specials: bool = False  # that parser needs special tokens left in the text
    engine: str = "sim"  # the engine(s) serving the model, for refusals that name them


def caps_for(engines: set[str]) -> Caps:
    real = bool(engines) and engines <= {"vllm"}
    return Caps(structured=real, logits=real, engine=", ".join(sorted(engines)) or "sim")


# What a refusal on the sim engine tells a newcomer, and where a real model's set-up is described
SIM_TEXT = "its text is random"
REAL_MODEL = 'a real model with engine = "vllm" (docs/deployment.md#real-vllm-workers)'


def _bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(invalid(message, param=param, code=code))


def _unsupported(param: str, what: str) -> ApiError:
    return _bad(param, f"'{param}' is not supported here: {what}.", "unsupported_parameter")


def _sampling_checks(body: ChatCompletionRequest | CompletionRequest, caps: Caps, tok: Tokenizer) -> None:
    stops = body.stops()
    if len(stops) > MAX_STOP:
        raise _bad("stop", f"Invalid value for 'stop': at most {MAX_STOP} stop sequences, got {len(stops)}.")
    if any(s == "" for s in stops):
        raise _bad("stop", "Invalid value for 'stop': stop sequences must not be empty.")
    if body.stream_options is not None:
        if not body.stream:
            raise _bad("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.")
        if body.stream_options.include_obfuscation:
            raise _unsupported("stream_options.include_obfuscation", "stream chunks are not padded")
    vocab = tok.vocab_size
    for k in body.logit_bias or {}:
        if not (k.isascii() and k.isdigit()) or int(k) >= vocab:
            raise _bad("logit_bias", f"Invalid key in 'logit_bias': {k!r} is not a token id in [0, {vocab}).")
    if any(t < 0 or t >= vocab for t in body.stop_token_ids or ()):
        raise _bad("stop_token_ids", f"Invalid value for 'stop_token_ids': token ids must be in [0, {vocab}).")
    logits = "the model's engine (sim) draws from its own distribution, not a model's logits"
    if body.top_k is not None and body.top_k not in (0, -1):
        if body.top_k < -1:
            raise _bad("top_k", "Invalid value for 'top_k': must be -1 (off) or at least 1.")
        if not caps.logits:
            raise _unsupported("top_k", logits)
    if body.min_p and not caps.logits:
        raise _unsupported("min_p", logits)
    if body.repetition_penalty is not None and body.repetition_penalty != 1.0 and not caps.logits:
        raise _unsupported("repetition_penalty", logits)


def _max_tokens(max_tokens: int | None, prompt_len: int, model: ModelConfig, prompt_param: str) -> int:
    ctx = model.max_context
    if max_tokens is None:
        # Like vLLM: no limit given means "up to the end of the context".
        if prompt_len >= ctx:
            raise _bad(prompt_param,
                       f"This model's maximum context length is {ctx} tokens. However, your {prompt_param} resulted "
                       f"in {prompt_len} tokens. Please reduce the length of the {prompt_param}.",
                       "context_length_exceeded")
        return ctx - prompt_len
    if prompt_len + max_tokens > ctx:
        raise _bad(prompt_param,
                   f"This model's maximum context length is {ctx} tokens. However, you requested "
                   f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, {max_tokens} in the "
                   f"completion). Please reduce the length of the {prompt_param} or completion.",
                   "context_length_exceeded")
    return max_tokens


def _sampling(body: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: int | None,
              structured: StructuredOutput | None, seed: int | None) -> SamplingParams:
    if body.min_tokens and body.min_tokens > max_tokens:
        raise _bad("min_tokens", f"'min_tokens' ({body.min_tokens}) must not exceed the completion's maximum "
                                 f"({max_tokens} tokens).")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=seed,
        stop=body.stops(),
        ignore_eos=body.ignore_eos,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
        min_tokens=body.min_tokens or 0,
        stop_token_ids=list(body.stop_token_ids or ()),
        logprobs=logprobs,
        structured=structured,
    )


def choice_seed(seed: int | None, i: int, base: int) -> int | None:
    """Choice i's seed: vLLM's own rule for n > 1 (seed + i). Without a seed, choice 0 keeps none (a
    random draw on real engines) and the others draw from `base`, so that choices differ on the sim engine."""
    if seed is not None:
        return seed + i
    return None if i == 0 else base + i


def _fan_out(body: ChatCompletionRequest | CompletionRequest, prompts: list[tuple[list[int], str]],
             model: ModelConfig, prompt_param: str, max_tokens: int | None, logprobs: int | None,
             structured: StructuredOutput | None, tools: ToolMode | None, base_seed: int,
             skip_special_tokens: bool = True) -> Prepared:
    n = body.n or 1
    if n * len(prompts) > MAX_CHOICES:
        raise _bad("n", f"Invalid value for 'n': at most {MAX_CHOICES} choices per request "
                        f"(n={n} x {len(prompts)} prompts).")
    stream = bool(body.stream)
    usage = stream and body.stream_options is not None and body.stream_options.include_usage
    out: list[Prepared] = []
    for p, (tokens, echo) in enumerate(prompts):
        mt = _max_tokens(max_tokens, len(tokens), model, prompt_param)
        for j in range(n):
            i = p * n + j  # vLLM's choice order: each prompt's n choices together
            sp = _sampling(body, mt, logprobs, structured, choice_seed(body.seed, j, base_seed))  # per prompt, like vLLM
            if not skip_special_tokens:
                sp = msgspec.structs.replace(sp, skip_special_tokens=False)
            out.append(Prepared(tokens, sp, stream, usage, index=i, echo=echo, tools=tools, counts_prompt=j == 0,
                                priority=body.priority))
    first = out[0]
    first.extra = out[1:]
    return first


# --- chat ------------------------------------------------------------------------------------------

def _tools_refusal(kind: str, default_choice: bool, model: str, caps: Caps, tok: Tokenizer) -> ApiError | None:
    """Why this model cannot take `tools` with tool_choice `kind` (none | auto | required | named;
    `default_choice`: none was given), naming the choices it can take, or saying plainly that it takes
    none; None when it can."""
    template = tok.has_chat_template  # every choice renders the tools into the prompt with it
    works = {"'none'": template, "'auto'": template and caps.tool_parser,
             "'required'": template and caps.structured, "a named function": template and caps.structured}
    label = "a named function" if kind == "named" else f"'{kind}'"
    if works[label]:
        return None
    can = [k for k, ok in works.items() if ok]
    if not can:
        sim = f"; it runs on the {caps.engine} engine ({SIM_TEXT})" if "sim" in caps.engine else ""
        return _bad("tools", f"Model {model!r} cannot use tools: tool calls need an engine with structured outputs "
                             f"and a tokenizer with a chat template, e.g. {REAL_MODEL}{sim}.", "unsupported_parameter")
    need = ("a tool-call parser for the model (tool_parser in the cluster file)" if kind == "auto" else
            f"structured outputs, which the {caps.engine} engine does not have")
    default = " (the default with tools)" if default_choice else ""
    takes = can[0] if len(can) == 1 else f"{', '.join(can[:-1])} or {can[-1]}"
    return _bad("tools" if default_choice else "tool_choice", f"tool_choice {label}{default} needs {need}; model "
                f"{model!r} takes tool_choice {takes}.", "unsupported_parameter")


def _tool_schema(body: ChatCompletionRequest, model: str, caps: Caps,
                 tok: Tokenizer) -> tuple[ToolMode | None, StructuredOutput | None]:
    """tool_choice -> how the reply becomes tool calls, and the JSON the engine must emit for it
    (vLLM's own way for named and required choices: structured outputs, no parser involved)."""
    tools, choice = body.tools, body.tool_choice
    if choice is not None and not tools:
        raise _bad("tool_choice", "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                                  "are specified.")
    if not tools:
        return None, None
    kind = "auto" if choice is None else choice if isinstance(choice, str) else "named"
    if (err := _tools_refusal(kind, choice is None, model, caps, tok)) is not None:
        raise err
    if choice == "none":
        return None, None
    if kind == "auto":
        request = body.model_dump(include={"model", "messages", "tools", "tool_choice"}, exclude_none=True,
                                  by_alias=True)
        request["tool_choice"] = "auto"
        return ToolMode("auto", request=request), None
    by_name = {t.function.name: t.function for t in tools}
    if isinstance(choice, str):  # "required": a JSON array of calls, each of one of the tools
        one_of = [{"properties": {"name": {"type": "string", "enum": [f.name]},
                                  "parameters": f.parameters or {"type": "object"}},
                   "required": ["name", "parameters"]} for f in by_name.values()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one_of}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolMode("required"), StructuredOutput(json_schema=json.dumps(schema))
    f = by_name.get(choice.function.name)
    if f is None:
        raise _bad("tool_choice", f"Invalid value for 'tool_choice': no tool named {choice.function.name!r} "
                                  "in 'tools'.")
    return ToolMode("named", f.name), StructuredOutput(json_schema=json.dumps(f.parameters or {"type": "object"}))


def _response_format(body: ChatCompletionRequest) -> StructuredOutput | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise _bad("response_format.json_schema", "Missing required parameter: 'response_format.json_schema' "
                                                  "(with its 'schema').")
    return StructuredOutput(json_schema=json.dumps(rf.json_schema.schema_))


def _chat_checks(body: ChatCompletionRequest) -> None:
    for name, what in REFUSED_CHAT.items():
        if getattr(body, name) is not None:
            raise _unsupported(name, what)
    if body.store:
        raise _unsupported("store", "completions are not stored")
    if body.service_tier not in (None, "auto", "default"):
        raise _unsupported("service_tier", "one tier only ('auto' / 'default')")
    if body.modalities is not None and body.modalities != ["text"]:
        raise _unsupported("modalities", "text output only")
    if body.prompt_cache_retention not in (None, "in-memory", "in_memory"):
        raise _unsupported("prompt_cache_retention", "prefixes stay in the workers' KV caches only")
    if body.top_logprobs and not body.logprobs:
        raise _bad("top_logprobs", "Invalid value for 'top_logprobs': 'logprobs' must be set to true when "
                                   "'top_logprobs' is used.")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise _bad("max_completion_tokens", "Set only one of 'max_tokens' and 'max_completion_tokens'.")
    if body.add_generation_prompt and body.continue_final_message:
        raise _bad("continue_final_message", "'continue_final_message' and 'add_generation_prompt' can not "
                                             "both be true.")
    for i, m in enumerate(body.messages):
        if m.role == "function":
            raise _unsupported(f"messages[{i}].role", "the deprecated 'function' role (use 'tool')")
        if m.audio is not None:
            raise _unsupported(f"messages[{i}].audio", "audio")
        if m.function_call is not None:
            raise _unsupported(f"messages[{i}].function_call", "the deprecated 'function_call' (use 'tool_calls')")


def prepare_chat(body: ChatCompletionRequest, model: ModelConfig, tok: Tokenizer, caps: Caps = Caps(),
                 base_seed: int = 0) -> Prepared:
    _chat_checks(body)
    _sampling_checks(body, caps, tok)
    tools, structured = _tool_schema(body, model.name, caps, tok)
    rf = _response_format(body)
    if structured is None:
        structured = rf
    elif rf is not None:
        raise _bad("response_format", "'response_format' cannot be combined with a forced 'tool_choice'.")
    if structured is not None and not caps.structured:
        sim = f" ({SIM_TEXT})" if "sim" in caps.engine else ""
        raise _unsupported("response_format", f"JSON output needs structured outputs, which the {caps.engine} "
                                              f"engine{sim} does not have; serve {REAL_MODEL}")
    if body.chat_template_kwargs and not tok.has_chat_template:
        raise _unsupported("chat_template_kwargs", "the model's tokenizer has no chat template")
    messages = [m.model_dump(exclude_none=True, include={"role", "content", "name", "tool_calls", "tool_call_id"})
                for m in body.messages]
    for d, m in zip(messages, body.messages, strict=True):
        d["content"] = m.text() if m.content is not None or m.role != "assistant" else None
    try:
        text = tok.render_chat(messages, tools=[t.model_dump(exclude_none=True) for t in body.tools or ()] or None,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               kwargs=body.chat_template_kwargs or {})
    except ValueError as exc:  # the template itself refused the messages (raise_exception in jinja)
        raise _bad("messages", f"The chat template rejected the messages: {exc}") from None
    tokens = tok.encode(text)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    keep = tools is not None and tools.kind == "auto" and caps.keeps_specials
    return _fan_out(body, [(tokens, "")], model, "messages", max_tokens, logprobs, structured, tools, base_seed,
                    skip_special_tokens=not keep)


# --- completions -----------------------------------------------------------------------------------

def prepare_completion(body: CompletionRequest, model: ModelConfig, tok: Tokenizer, caps: Caps = Caps(),
                       base_seed: int = 0) -> Prepared:
    _sampling_checks(body, caps, tok)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise _unsupported("best_of", "best_of must equal n (every candidate is returned)")
    if body.suffix:
        raise _unsupported("suffix", "insertion (fill-in-the-middle) is not implemented")
    if body.echo and body.logprobs is not None:
        raise _unsupported("echo", "echo with logprobs needs prompt logprobs, which are not computed")
    p = body.prompt
    raw: list[str | list[int]]
    if isinstance(p, str):
        raw = [p]
    elif p and isinstance(p[0], list | str):
        raw = list(p)  # type: ignore[arg-type]
    else:
        raw = [p]  # type: ignore[list-item]  # one prompt of token ids
    if not raw:
        raise _bad("prompt", "Invalid value for 'prompt': the list of prompts is empty.")
    vocab = tok.vocab_size
    prompts: list[tuple[list[int], str]] = []
    for i, one in enumerate(raw):
        where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            tokens = tok.encode(one)
            text = one
        else:
            tokens = list(one)
            if any(t < 0 or t >= vocab for t in tokens):
                raise _bad(where, f"Invalid value for '{where}': token ids must be in [0, {vocab}).")
            text = tok.decode(tokens) if body.echo else ""
        if not tokens:
            raise _bad(where, f"Invalid value for '{where}': the prompt is empty.")
        prompts.append((tokens, text if body.echo else ""))
    return _fan_out(body, prompts, model, "prompt", body.max_tokens, body.logprobs, None, None, base_seed)
