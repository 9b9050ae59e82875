import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.kvindex.blocks import leading_blocks
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


async def test_index_survives_script_flush_and_killed_connections(index: PrefixIndex) -> None:
    await index.apply(KvEvent(worker_id="a", model="m", stored=[1, 2]))
    await index.r.script_flush()  # e.g. a Redis restart: EVALSHA answers NOSCRIPT
    assert await index.lookup("m", [1, 2, 3]) == {"a": 2}
    await index.r.client_kill_filter(_type="normal", skipme=True)  # drops the pooled connections
    await asyncio.sleep(0.05)
    await index.apply(KvEvent(worker_id="b", model="m", stored=[1]))
    assert await index.lookup("m", [1, 2], live_workers=["a", "b"]) == {"a": 2, "b": 1}


async def test_concurrent_lookups_get_their_own_replies(index: PrefixIndex) -> None:
    # Concurrent callers share the client's pool: each must get its own reply.
    for w in range(8):
        await index.apply(KvEvent(worker_id=f"w{w}", model="m", stored=list(range(w + 1))))
    got = await asyncio.gather(*(index.lookup("m", list(range(n)), [f"w{n - 1}"]) for n in range(1, 9)))
    assert got == [{f"w{n - 1}": n} for n in range(1, 9)]


_holdings = st.dictionaries(st.sampled_from(["w0", "w1", "w2", "w3"]),
                            st.sets(st.integers(0, 7), max_size=8), max_size=4)


@settings(max_examples=40, deadline=None)
@given(held=_holdings, hashes=st.lists(st.integers(0, 7), max_size=8),
       live=st.none() | st.sets(st.sampled_from(["w0", "w1", "w2", "w3"]), min_size=1))
def test_the_redis_walk_is_the_python_walk(redis_url: str, held: dict[str, set[int]], hashes: list[int],
                                          live: set[str] | None) -> None:
    """One prefix walk: the index's Lua lookup and hetmesh.kvindex.blocks.leading_blocks (the simulator's)
    agree on any holdings, prompt and live set."""

    async def go() -> dict[str, int]:
        idx = PrefixIndex.from_url(redis_url, ttl_s=30)
        try:
            await idx.r.flushdb()
            for w, hs in held.items():
                await idx.apply(KvEvent(worker_id=w, model="m", stored=sorted(hs)))
            return await idx.lookup("m", hashes, live_workers=live)
        finally:
            await idx.close()

    def holders(h: int) -> set[str]:
        return {w for w, hs in held.items() if h in hs and (live is None or w in live)}

    assert asyncio.run(go()) == leading_blocks(hashes, holders)
