"""The pure side of OpenAI fidelity: bodies -> mesh requests (gateway/params.py), and forced tool calls
in the response bytes (core.Formatter). The mesh-level walk of every parameter is tests/e2e/test_openai_params.py."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from hetmesh.config import ModelConfig
from hetmesh.gateway.core import ApiError, Formatter
from hetmesh.gateway.params import Caps, prepare_chat, prepare_completion
from hetmesh.gateway.schemas import ChatCompletionRequest, CompletionRequest
from hetmesh.protocol import TokenChunk
from hetmesh.tokenizer import ByteTokenizer

MODEL = ModelConfig(name="m", max_context=512)
TOK = ByteTokenizer()
VLLM = Caps(structured=True, logits=True, engine="vllm")
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                     "properties": {"x": {"type": "integer"}}}}}


def chat(caps: Caps = Caps(), **kw: Any):  # type: ignore[no-untyped-def]
    return prepare_chat(ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, **kw}), MODEL, TOK, caps,
                        base_seed=100)


def refused(param: str, fn: Any, *args: Any, **kw: Any) -> None:
    with pytest.raises(ApiError) as e:
        fn(*args, **kw)
    assert e.value.info.status == 400 and e.value.info.param == param, e.value.info


def test_n_and_prompts_fan_out_with_vllms_seeds() -> None:
    p = chat(n=3, seed=7, max_tokens=5)
    choices = [p, *p.extra]
    assert [c.index for c in choices] == [0, 1, 2] and [c.sampling.seed for c in choices] == [7, 8, 9]
    assert [c.counts_prompt for c in choices] == [True, False, False]
    unseeded = chat(n=2, max_tokens=5)
    assert [c.sampling.seed for c in (unseeded, *unseeded.extra)] == [None, 101]  # distinct on the sim engine too
    body = CompletionRequest.model_validate({"model": "m", "prompt": [[104, 105], [106]], "n": 2, "seed": 1,
                                             "echo": True, "max_tokens": 3})
    c = prepare_completion(body, MODEL, TOK)
    got = [(x.index, x.prompt_tokens, x.sampling.seed, x.echo) for x in (c, *c.extra)]
    assert got == [(0, [104, 105], 1, "hi"), (1, [104, 105], 2, "hi"), (2, [106], 1, "j"), (3, [106], 2, "j")]


def test_sampling_options_reach_the_mesh_request() -> None:
    s = chat(VLLM, max_tokens=9, presence_penalty=0.5, frequency_penalty=-1, logit_bias={"97": -100}, min_tokens=2,
             stop_token_ids=[10], top_k=4, min_p=0.1, repetition_penalty=1.2, logprobs=True, top_logprobs=3).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias, s.min_tokens, s.stop_token_ids) == \
        (0.5, -1.0, {97: -100.0}, 2, [10])
    assert (s.top_k, s.min_p, s.repetition_penalty, s.logprobs) == (4, 0.1, 1.2, 3)
    assert msgspec.json.decode(msgspec.json.encode(s), type=type(s)) == s  # it crosses NATS as it is


def test_what_the_engines_cannot_do_is_refused_by_name() -> None:
    refused("top_k", chat, top_k=5)
    refused("repetition_penalty", chat, repetition_penalty=1.5)
    refused("response_format", chat, response_format={"type": "json_object"})
    refused("tools", chat, VLLM, tools=[TOOL], tool_choice="required")  # byte tokenizer: no template for tools
    refused("logit_bias", chat, logit_bias={"²": 1})  # a digit, but not a token id
    refused("n", lambda: prepare_completion(CompletionRequest.model_validate(
        {"model": "m", "prompt": ["a"] * 20, "n": 7, "max_tokens": 1}), MODEL, TOK))  # 140 mesh requests
    refused("min_tokens", chat, max_tokens=2, min_tokens=3)
    refused("continue_final_message", chat, continue_final_message=True)


class TemplateTok(ByteTokenizer):
    has_chat_template = True  # refusals come before any rendering


def test_a_tools_refusal_names_what_works_or_says_the_model_cannot() -> None:
    def says(caps: Caps, tok: ByteTokenizer, **kw: Any) -> tuple[str | None, str]:
        with pytest.raises(ApiError) as e:
            prepare_chat(ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, "tools": [TOOL], **kw}),
                         MODEL, tok, caps)
        return e.value.info.param, e.value.info.message

    # the default mesh (sim engine, byte tokenizer): every choice gets the one answer, with the way out
    sim = Caps(engine="sim")
    named = {"type": "function", "function": {"name": "f"}}
    for kw in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}, {"tool_choice": "required"}, {"tool_choice": named}):
        param, msg = says(sim, TOK, **kw)
        assert param == "tools" and "Model 'm' cannot use tools" in msg, kw
        assert 'engine = "vllm"' in msg and "sim engine (its text is random)" in msg and "tool_choice '" not in msg
    # a template but no structured outputs: only 'none' works, and the refusal says so
    assert says(sim, TemplateTok(), tool_choice="required") == (
        "tool_choice", "tool_choice 'required' needs structured outputs, which the sim engine does not have; "
                       "model 'm' takes tool_choice 'none'.")
    # vLLM without a tool-call parser: everything but 'auto' (the default with tools)
    param, msg = says(VLLM, TemplateTok())
    assert param == "tools" and msg.startswith("tool_choice 'auto' (the default with tools) needs a tool-call parser")
    assert msg.endswith("takes tool_choice 'none', 'required' or a named function.")
    param, msg = says(Caps(engine="sim"), TOK, response_format={"type": "json_object"}, tools=None)
    assert param == "response_format" and "sim engine (its text is random)" in msg and 'engine = "vllm"' in msg


def test_forced_tool_calls_in_the_response() -> None:
    prep = chat(VLLM, max_tokens=20)  # the tool mode is set by params; here set by hand on a plain chat
    from hetmesh.gateway.core import ToolMode

    def choice(mode: ToolMode, text: str, finish: str = "stop") -> dict[str, Any]:
        prep.tools = mode
        chunk = TokenChunk(request_id="r", worker_id="w", index=0, token_ids=[1], text=text, finish_reason=finish)
        return Formatter(True, "chatcmpl-r1", "m", 1, False, prep).choice([chunk], finish)

    named = choice(ToolMode("named", "f"), '{"x": 1}')
    assert named["finish_reason"] == "stop" and named["message"]["content"] is None
    assert named["message"]["tool_calls"] == [{"id": "call_r1_0_0", "type": "function",
                                               "function": {"name": "f", "arguments": '{"x": 1}'}}]
    req = choice(ToolMode("required"), '[{"name": "f", "parameters": {"x": 2}}, {"name": "f", "parameters": {}}]')
    assert req["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in req["message"]["tool_calls"]] == [{"x": 2}, {}]
    cut = choice(ToolMode("named", "f"), '{"x": 12', "length")  # cut short: the text as it is
    assert cut["message"]["content"] == '{"x": 12' and cut["finish_reason"] == "length"
