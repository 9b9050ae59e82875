"""A client's retries of a request the mesh refused (the official openai client retries a 429 twice by itself):
the gateway hands the scheduler each retry's wait since the first send, so admission judges it by the TTFT its
user sees. A real gateway process; the scripted peer refuses and records what it was sent."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from hetmesh.protocol import InferenceRequest

from .conftest import FakePeer, GatewayProc


def prompt_of(req: InferenceRequest) -> str:
    return bytes(t for t in req.prompt_tokens if t < 256).decode(errors="replace")


def test_each_retry_of_a_refused_request_carries_its_wait_since_the_first_send(gateway: GatewayProc,
                                                                              peer: FakePeer) -> None:
    tag = f"reject {uuid.uuid4().hex}"
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=2, timeout=20)
    with pytest.raises(openai.RateLimitError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": tag}], max_tokens=2)
    waits = [s.waited_s for s in peer.submits if tag in prompt_of(s)]
    assert len(waits) == 3 and waits[0] == 0.0 < waits[1] < waits[2], waits
    # the client's own backoff between tries is in it (the openai client waits at least 0.5 s, then 1 s)
    assert waits[2] >= waits[1] + 0.4, waits
    # the same body sent afresh, not as a retry, starts its own clock
    r = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=20,
                   json={"model": "tiny", "messages": [{"role": "user", "content": tag}], "max_tokens": 2})
    assert r.status_code == 429
    assert [s.waited_s for s in peer.submits if tag in prompt_of(s)][-1] == 0.0
    # another body's retry (a request this gateway never refused) waited nothing it knows of
    other = f"plain {uuid.uuid4().hex}"
    r = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=20, headers={"x-stainless-retry-count": "1"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": other}], "max_tokens": 2})
    assert r.status_code == 200
    assert [s.waited_s for s in peer.submits if other in prompt_of(s)] == [0.0]
