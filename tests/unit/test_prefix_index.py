import time

import pytest

from hetmesh.kvindex.index import PrefixIndex
from hetmesh.protocol import KvEvent


@pytest.fixture
async def index(redis_url: str):  # type: ignore[no-untyped-def]
    idx = PrefixIndex.from_url(redis_url, ttl_s=30)
    await idx.r.flushdb()
    yield idx
    await idx.close()


async def test_lookup_counts_leading_blocks_only(index: PrefixIndex) -> None:
    await index.apply(KvEvent(worker_id="a", model="m", stored=[1, 2, 3]))
    await index.apply(KvEvent(worker_id="b", model="m", stored=[1, 3]))
    assert await index.lookup("m", [1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert await index.lookup("other", [1, 2]) == {}


async def test_removed_live_filter_and_drop_worker(index: PrefixIndex) -> None:
    await index.apply(KvEvent(worker_id="a", model="m", stored=[1, 2]))
    await index.apply(KvEvent(worker_id="b", model="m", stored=[1, 2]))
    await index.apply(KvEvent(worker_id="a", model="m", removed=[2]))
    assert await index.lookup("m", [1, 2]) == {"a": 1, "b": 2}
    assert await index.lookup("m", [1, 2], live_workers=["a"]) == {"a": 1}
    await index.drop_worker("b")
    assert await index.lookup("m", [1, 2]) == {"a": 1}
    await index.apply(KvEvent(worker_id="a", model="m", cleared=True))
    assert await index.lookup("m", [1, 2]) == {}


async def test_stale_entries_are_ignored(index: PrefixIndex) -> None:
    await index.apply(KvEvent(worker_id="old", model="m", stored=[7], ts=time.time() - 3600))
    assert await index.lookup("m", [7]) == {}
