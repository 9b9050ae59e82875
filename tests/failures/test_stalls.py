"""A process that stops running for a while (SIGSTOP: a GC pause, CPU starvation of a loaded host) is not a dead
one, and its peers' silence meanwhile is not theirs.

- The scheduler stopped for three heartbeat timeouts: when it runs again, the workers' heartbeats still wait
  unread in its socket; it declares no worker lost, and every stream goes on untouched.
- The sole worker stopped past its heartbeat timeout: the scheduler cannot tell it from a dead one and counts
  it lost; its streams migrate, and their retry, which avoids the lost worker, is placed back on it once its
  heartbeats return (it is the only worker of its model) instead of getting a 503.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import openai
import pytest

from hetmesh.launcher import Mesh

from ..clusters import cluster_toml, group, model
from ..e2e.conftest import EventLog, collect_events, running_mesh
from .conftest import HEARTBEAT_TIMEOUT_S, STEADY_MESH, expected_text

CLUSTER = cluster_toml(mesh=STEADY_MESH, scheduler={"policy": "least_loaded"},
                       models=[model("m", spec="llama-3.1-8b", max_context=8192, block_size=16)],
                       workers=[group("solo", "m", "nvidia-h100", role="both", count=1)])


@pytest.fixture(scope="module")
def mesh1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("stalls"), CLUSTER) as m:
        yield m


async def _streamed(c: openai.AsyncOpenAI, prompt: str, max_tokens: int, first: asyncio.Event) -> str:
    s = await c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, stream=True,
                                   extra_body={"ignore_eos": True})
    out = []
    async for ch in s:
        if ch.choices:
            out.append(ch.choices[0].text)
            first.set()
    return "".join(out)


async def _stall(m: Mesh, service: str, seconds: float, log: EventLog) -> list[str]:
    """Three streams; `service` stopped for `seconds` once they stream; their texts."""
    c = openai.AsyncOpenAI(base_url=f"{m.url}/v1", api_key="unused", max_retries=0, timeout=60)
    firsts = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(_streamed(c, f"{service} stalled {i}", 40, firsts[i])) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
    proc = m.services[service].proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert out == [expected_text(f"{service} stalled {i}", 40) for i in range(3)], [
        (e.request_id, e.kind, e.detail) for e in log.events if e.request_id]
    return out


async def test_a_stalled_scheduler_declares_no_worker_lost(mesh1: Mesh) -> None:
    async for log in collect_events(mesh1.nats_url):
        await _stall(mesh1, "scheduler", 3 * HEARTBEAT_TIMEOUT_S, log)
        assert not [e for e in log.events if e.kind in ("worker_lost", "migrated", "retried")], log.events


async def test_a_stalled_sole_worker_serves_its_streams_again_once_back(mesh1: Mesh) -> None:
    async for log in collect_events(mesh1.nats_url):
        await _stall(mesh1, "worker:solo-0", 1.6 * HEARTBEAT_TIMEOUT_S, log)
        assert [e for e in log.events if e.kind == "worker_lost"], "the stall was long enough to be taken for death"
        assert [e for e in log.events if e.kind in ("migrated", "retried")]
