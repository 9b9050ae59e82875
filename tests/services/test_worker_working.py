"""A worker says `Working` on a request's reply subject while the request has no token from it yet, every quarter
of the stall timeout, so that the gateway waits out a prefill longer than that timeout; once the tokens flow, it
says nothing more. A real worker process (sim engine, slowed down) against a real nats-server, driven as the
scheduler drives it (test_worker_kv.py's mesh and tap)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from tests.clusters import cluster_toml, group, model
from tests.services.test_worker_kv import (
    MODEL,
    Mesh,
    Tap,
    _run_mesh,
    _tap,
    expected,
    final,
    make_item,
    text_of,
)

from hetmesh import subjects
from hetmesh.bus import encode
from hetmesh.protocol import TokenChunk, Working

STALL_S = 2.0
CLUSTER = cluster_toml(
    mesh={"time_scale": 0.05, "heartbeat_interval_s": 0.2,
          "stall_timeout_s": STALL_S},  # `Working` every 0.4 s (two heartbeats)
    models=[model(MODEL, spec="llama-3.1-8b", block_size=16)],
    # a chunked prefill: the engine's counters move every chunk (a stuck engine's would not)
    workers=[group("slow", MODEL, "nvidia-a100-80g", role="both", step_tokens=256)])
SLOW = "slow-0"


@pytest.fixture(scope="module")
def slow_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from _run_mesh(tmp_path_factory.mktemp("worker-working"), CLUSTER, [SLOW])


@pytest.fixture(scope="module")
async def slow_tap(slow_mesh: Mesh) -> AsyncIterator[tuple[Tap, nats.NATS]]:
    async for tap, nc in _tap(slow_mesh):
        await tap.until(lambda beats=tap.heartbeats: any(h.worker_id == SLOW for h in beats), timeout_s=60)
        yield tap, nc


async def test_a_prefill_longer_than_the_stall_timeout_says_it_is_working(slow_tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = slow_tap
    item = make_item("a long prompt for a slow chip " * 60, 8, decode_worker=SLOW)  # 1,800 tokens: ~3 s of prefill
    await nc.publish(subjects.work_direct("both", "nvidia", "nvidia-a100-80g", SLOW), encode(item))
    last = await t.until(lambda: final(t, item), timeout_s=60)
    assert isinstance(last, TokenChunk)
    ids, text, _ = expected(item)
    assert text_of(t, item) == (ids, text)
    got = t.replies[item.request.reply_subject]
    first = next(i for i, m in enumerate(got) if isinstance(m, TokenChunk))
    working = [m for m in got[:first] if isinstance(m, Working)]
    # the prefill outlasted the stall timeout, and the gateway heard from the worker in every quarter of it
    assert len(working) >= 4 and {m.worker_id for m in working} == {SLOW}
    assert not any(isinstance(m, Working) for m in got[first:])
