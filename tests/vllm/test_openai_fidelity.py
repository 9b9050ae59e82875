"""OpenAI fidelity with the real `vllm` engine (the tiny random-weight Llama on the CPU), one mesh with one
vLLM worker: chats rendered exactly as vLLM's own OpenAI server renders them, structured outputs and
forced tool calls well formed even from random weights, logprobs / n / logit_bias passed through."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from hetmesh.config import ModelConfig
from hetmesh.gateway.params import Caps, prepare_chat
from hetmesh.gateway.schemas import ChatCompletionRequest
from hetmesh.tokenizer import HFTokenizer

from ..clusters import cluster_toml, group
from ..e2e.conftest import running_mesh
from ..openai_shape import chat_text
from .conftest import tiny_model_entry

# A template in the style of the Llama 3.1 family: tools in a system turn, tool calls as JSON, tool results.
TEMPLATE = """{%- if tools %}<|system|>
Tools you may call:
{% for t in tools %}{{ t | tojson }}
{% endfor %}{%- endif %}
{%- for m in messages %}
{%- if m['role'] == 'assistant' and m['tool_calls'] is defined %}<|assistant|>
{% for c in m['tool_calls'] %}{"name": "{{ c['function']['name'] }}", "parameters": {{ c['function']['arguments'] | tojson }}}
{% endfor %}
{%- elif m['role'] == 'tool' %}<|ipython|>
{{ m['content'] }}
{% else %}<|{{ m['role'] }}|>
{{ m['content'] }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hello there"}]},
    {"messages": [{"role": "developer", "content": "be brief"}, {"role": "system", "content": "you are a mesh"},
                  {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]},
    {"messages": [{"role": "user", "content": "weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"celsius\": true}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "-3"}],
     "tools": [WEATHER], "tool_choice": "none"},
    {"messages": [{"role": "user", "content": "finish this"}, {"role": "assistant", "content": "the mesh"}],
     "add_generation_prompt": False, "continue_final_message": True},
]


def cluster(model_dir: Path) -> str:
    return cluster_toml(mesh={"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0, "stall_timeout_s": 120.0},
                        models=[tiny_model_entry("tiny-chat", model_dir)],
                        workers=[group("cpu", "tiny-chat", "nvidia-h100", engine="vllm", max_batch=8)])


@pytest.fixture(scope="module")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a template that renders tools, tool calls and tool results."""
    d = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_model, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return d


def test_chat_rendering_is_vllms_own(chat_model: Path) -> None:
    """The gateway's prompt tokens for each conversation == vLLM's OpenAI server's rendering (its own
    message parsing and template application), tokenized the way vLLM tokenizes a rendered chat."""
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig as VllmModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    mc = VllmModelConfig(model=str(chat_model), tokenizer=str(chat_model), dtype="float32", max_model_len=1024)
    hf = AutoTokenizer.from_pretrained(str(chat_model))
    tok = HFTokenizer(str(chat_model / "tokenizer.json"))
    model = ModelConfig(name="tiny-chat", tokenizer=str(chat_model / "tokenizer.json"), max_context=1024)
    for conv in CONVERSATIONS:
        tools = conv.get("tools")
        fmt = resolve_chat_template_content_format(chat_template=None, tools=tools, given_format="auto",
                                                   tokenizer=hf, model_config=mc)
        parsed, _, _ = parse_chat_messages(copy.deepcopy(conv["messages"]), mc, content_format=fmt)  # it edits them
        text = safe_apply_chat_template(mc, hf, parsed, tools=tools, tokenize=False,
                                        add_generation_prompt=conv.get("add_generation_prompt", True),
                                        continue_final_message=conv.get("continue_final_message", False))
        want = hf.encode(text, add_special_tokens=False)
        body = ChatCompletionRequest.model_validate({"model": "tiny-chat", "max_tokens": 4, **conv})
        got = prepare_chat(body, model, tok, Caps(structured=True, logits=True)).prompt_tokens
        assert tok.decode(got) == hf.decode(want, skip_special_tokens=True), conv
        assert got == want, conv


@pytest.fixture(scope="module")
def client(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with running_mesh(tmp_path_factory.mktemp("fidelity-mesh"), cluster(chat_model),
                      ready_timeout_s=400, env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}) as m:
        yield openai.OpenAI(base_url=f"{m.url}/v1", api_key="unused", max_retries=0, timeout=300)


PERSON = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "count": {"enum": [1, 2, 3]}},
          "required": ["color", "ok", "count"], "additionalProperties": False}


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": PERSON}}
    r = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "a thing"}],
                                       max_tokens=200, temperature=0, response_format=rf)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)


def test_forced_tool_calls_are_well_formed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", messages=[{"role": "user", "content": "weather?"}], max_tokens=200,
                              temperature=0, tools=[WEATHER])
    params = WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**kw, tool_choice=named)
    msg = r.choices[0].message
    assert msg.content is None and msg.tool_calls and len(msg.tool_calls) == 1, msg
    assert msg.tool_calls[0].function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), params)
    r = client.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), params)
    # Streamed as OpenAI does: a role-only chunk, the call as a tool-call delta, an empty delta with the finish reason.
    chunks = list(client.chat.completions.create(**kw, tool_choice=named, stream=True))
    role, call, end = (c.choices[0] for c in chunks)
    assert (role.delta.role, role.delta.content, role.delta.tool_calls, role.finish_reason) == ("assistant", None,
                                                                                               None, None)
    (delta,) = call.delta.tool_calls or []
    assert call.finish_reason is None and delta.function.name == "get_weather" and delta.id
    assert delta.function.arguments == msg.tool_calls[0].function.arguments  # greedy: the same call
    assert (end.delta.content, end.delta.tool_calls, end.finish_reason) == (None, None, "stop")


def test_logprobs_n_and_logit_bias_reach_vllm(client: openai.OpenAI, chat_model: Path) -> None:
    kw: dict[str, Any] = dict(model="tiny-chat", messages=[{"role": "user", "content": "count"}], max_tokens=8,
                              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    for e in content:  # greedy: the drawn token is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(**kw, temperature=0, logprobs=True, stream=True))
    assert chat_text(chunks, finish="length") == r.choices[0].message.content  # OpenAI's chunk sequence
    streamed = [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or ()]
    assert streamed == [e.token for e in content]
    # logit_bias +100 on one token: greedy emits only it.
    tok = HFTokenizer(str(chat_model / "tokenizer.json"))
    target = tok.encode(" mesh")[0]
    r = client.chat.completions.create(**kw, temperature=0, logit_bias={str(target): 100}, logprobs=True)
    assert {e.token for e in r.choices[0].logprobs.content or ()} == {tok.decode_one(target)}  # type: ignore[union-attr]
    # n = 2 with a seed: two choices, each the same as the single request with seed + i.
    two = client.chat.completions.create(**kw, n=2, seed=4, temperature=1.0)
    singles = [client.chat.completions.create(**kw, seed=4 + i, temperature=1.0).choices[0].message.content
               for i in range(2)]
    assert [c.message.content for c in two.choices] == singles
    assert two.usage is not None and two.usage.completion_tokens == 16
    assert two.usage.prompt_tokens_details is not None and two.usage.prompt_tokens_details.cached_tokens is not None



def test_auto_tool_choice_is_read_by_vllms_parser(chat_model: Path, tmp_path: Path) -> None:
    """tool_choice "auto" with `tool_parser = "hermes"`: the reply text goes through vLLM's Hermes parser
    in the gateway; calls and the text before them come back in OpenAI's shape, streamed or not."""
    from transformers import AutoTokenizer

    from hetmesh.gateway.core import Formatter
    from hetmesh.gateway.toolcalls import ToolParsing
    from hetmesh.protocol import TokenChunk

    d = tmp_path / "hermes-tok"  # the family's call markers as special tokens, as in Hermes models
    hf = AutoTokenizer.from_pretrained(str(chat_model))
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    hf.save_pretrained(d)
    parsing = ToolParsing("hermes", d)
    assert parsing.keeps_specials  # Hermes needs its markers left in the text
    tok = HFTokenizer(str(d / "tokenizer.json"))
    model = ModelConfig(name="m", tokenizer=str(d / "tokenizer.json"), max_context=1024, tool_parser="hermes")
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Oslo?"}],
                                                 "tools": [WEATHER], "max_tokens": 64})
    prep = prepare_chat(body, model, tok, Caps(structured=True, logits=True, tool_parser=True, keeps_specials=True))
    assert prep.tools is not None and prep.tools.kind == "auto"
    assert prep.sampling.structured is None and prep.sampling.skip_special_tokens is False
    text = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}</tool_call>'

    def chunk(t: str) -> TokenChunk:
        return TokenChunk(request_id="r", worker_id="w", index=0, token_ids=[1], text=t, finish_reason="stop")

    fmt = Formatter(True, "chatcmpl-x", "m", 1, False, prep, None, parsing.parse)
    choice = fmt.choice([chunk(text)], "stop")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "celsius": True}
    plain = fmt.choice([chunk("no tools needed")], "stop")
    assert plain["message"] == {"role": "assistant", "content": "no tools needed", "refusal": None}
    events = [json.loads(line[6:]) for line in Formatter(True, "chatcmpl-x", "m", 1, False, prep, None, parsing.parse)
              .sse_chunks([chunk(text)], first=True).decode().split("\n\n") if line.startswith("data: ")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": None} and deltas[1] == {"content": "Checking. "}
    assert deltas[2]["tool_calls"][0]["function"]["name"] == "get_weather" and deltas[3] == {}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
