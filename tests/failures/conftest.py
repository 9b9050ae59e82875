"""One mesh for the failure tests (test_failures.py, test_migration.py), and their helpers.

An aggregated model on two H100 workers and a disaggregated one on two prefill (Rubin CPX) and two
decode (Rubin VR200) workers, so a dead worker always has a stand-in. Engine time is slowed down so
that a kill lands inside the phase it targets: a 6000-token prefill takes about a second, a decode
token about 0.2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from hetmesh.engines.sampling import expected_completion
from hetmesh.launcher import Mesh
from hetmesh.protocol import SamplingParams, ServiceEvent
from hetmesh.tokenizer import ByteTokenizer

from ..clusters import cluster_toml, group, model
from ..e2e.conftest import EventLog, collect_events, running_mesh

TOK = ByteTokenizer()
HEARTBEAT_TIMEOUT_S = 1.0
# llama-3.1-8b at time scale 0.05: a decode token takes ~0.2 s, so a 40-token stream runs ~8 s; losses are seen
# within a second
STEADY_MESH = {"time_scale": 0.05, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
               "stall_timeout_s": 30.0, "max_attempts": 3}
KV_LANDED_TIMEOUT_S = 8.0
DRAIN_TIMEOUT_S = 3.0
CLUSTER = cluster_toml(
    mesh={"time_scale": 0.05, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0, "stall_timeout_s": 30.0,
          # a busy engine's counters stand still this long: wedged (an 8K-token prefill step on an H100 is ~5.5 s here)
          "wedge_timeout_s": 10.0,
          "max_attempts": 3, "migration_limit": 3},
    # storage: a model switch loads llama-3.1-8b's 16 GB in 0.05 engine s: 1 s of wall time
    worker={"drain_timeout_s": DRAIN_TIMEOUT_S, "storage_bytes_per_s": 3.2e11},
    gateway={"scheduler_wait_s": 30.0},
    planner={"interval_s": 1.0,  # the scheduler's demand reports and the test_replanning planners' rounds
             "lease_ttl_s": 4.0,  # renewed every 1.3 s: a planner starved that long on a busy machine keeps its lease
             "window_s": 20.0},
    scheduler={"policy": "prefix_aware"},
    kv_transfer={"max_wire_bytes": 134217728},  # 128 MiB: a long prompt's transfer takes a while, but not forever
    models=[model("pd", spec="llama-3.1-8b", max_context=8192, block_size=16),
            model("agg", spec="llama-3.1-8b", max_context=8192, block_size=16)],
    workers=[group("cpx", "pd", "nvidia-rubin-cpx", role="prefill", count=2),
             group("vr200", "pd", "nvidia-rubin-vr200", role="decode", count=2),
             group("h100", "agg", "nvidia-h100", role="both", count=2)])


@pytest.fixture(scope="package")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("failures"), CLUSTER, ready_timeout_s=120,
                      env={"HETMESH_KV_LANDED_TIMEOUT_S": str(KV_LANDED_TIMEOUT_S)}) as m:
        yield m


@pytest.fixture(scope="package")
async def events(mesh: Mesh) -> AsyncIterator[EventLog]:
    async for log in collect_events(mesh.nats_url):
        yield log


@pytest.fixture(scope="package")
def aclient(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=120)


def expected_text(prompt: str, max_tokens: int) -> str:
    return expected_completion(TOK, TOK.encode(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))[1]


def complete(aclient: openai.AsyncOpenAI, prompt: str, max_tokens: int, model: str = "pd") -> asyncio.Task[Any]:
    return asyncio.create_task(aclient.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                          extra_body={"ignore_eos": True}))


async def first_placed(events: EventLog, since: float) -> ServiceEvent:
    """The scheduler's first `placed` event after `since` (the tests send one request at a time)."""
    async with asyncio.timeout(30):
        while True:
            for e in events.events:
                if e.kind == "placed" and e.service == "scheduler" and e.ts >= since:
                    return e
            await asyncio.sleep(0.02)


def respawn(mesh: Mesh, name: str) -> None:
    """Start `name` again and wait until it serves: the gateway's count of live workers may still hold the
    old process (its heartbeats have not timed out yet), so its own /ready is asked too."""
    mesh.spawn(name)
    mesh.wait_ready(90)
    url = mesh.metrics_urls()[name].removesuffix("/metrics") + "/ready"
    deadline = time.monotonic() + 90
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready at {url}")
        time.sleep(0.1)


class Sse:
    """One streamed completion as the client saw it: its chunks, whether [DONE] came, its request id."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.done = False

    @property
    def request_id(self) -> str:
        return str(self.chunks[0]["id"]).split("-", 1)[1]  # "cmpl-<request id>"

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for c in self.chunks if c.get("choices"))

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [c for c in self.chunks if "error" in c]


async def stream(mesh: Mesh, model: str, prompt: str, max_tokens: int,
                 on_chunk: Callable[[Sse], Awaitable[bool]] | None = None) -> Sse:
    """Stream a completion; after each chunk `on_chunk(sse)` may act (kill, drain) and returns False to
    hang up (the client goes away)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    got = Sse()
    async with httpx.AsyncClient(base_url=mesh.url, timeout=90) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, (resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    got.done = True
                elif line.startswith("data: "):
                    got.chunks.append(json.loads(line[6:]))
                    if on_chunk is not None and not await on_chunk(got):
                        break
    return got
