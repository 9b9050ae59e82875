"""The worker's log of published chunks, from which a stream's hole is filled after a bus gap."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hetmesh.worker.replay import ReplayLog


def test_since_returns_the_chunks_holding_later_tokens_and_the_finish_marker() -> None:
    log = ReplayLog()
    for index, tokens, data in ((0, 1, b"first"), (1, 3, b"1-3"), (4, 2, b"4-5"), (6, 0, b"finish")):
        log.add("resp.a", index, tokens, data)
    log.add("resp.b", 0, 5, b"other stream")
    assert log.since("resp.a", 0) == [b"first", b"1-3", b"4-5", b"finish"]
    assert log.since("resp.a", 2) == [b"1-3", b"4-5", b"finish"]  # token 2 is inside the second chunk
    assert log.since("resp.a", 6) == [b"finish"]
    assert log.since("resp.a", 7) == []
    assert log.since("resp.unknown", 0) == []


@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(1, 300)), max_size=200))
def test_bounds_evict_whole_streams_oldest_first(adds: list[tuple[str, int]]) -> None:
    log = ReplayLog(max_bytes=1000, max_streams=4)
    order: list[str] = []
    for subject, size in adds:
        log.add(subject, 0, 1, b"x" * size)
        if subject not in order:
            order.append(subject)
        order = [s for s in order if s in log.streams]
        assert log.bytes <= 1000 and len(log.streams) <= 4
        assert log.bytes == sum(len(d) for chunks in log.streams.values() for _, _, d in chunks)
        assert list(log.streams) == order  # what is left is the newest streams, in the order they began


def test_recent_gives_every_chunk_of_the_streams_added_to_since() -> None:
    # After the worker's own reconnect it sends again the streams it published on lately, whole: a short one may
    # have gone down entirely with its connection, and no gateway asks for a stream it never heard of
    log = ReplayLog()
    log.add("resp.old", 0, 2, b"old 0-1", now=1.0)
    log.add("resp.new", 0, 1, b"new 0", now=2.0)
    log.add("resp.old2", 0, 1, b"old2 0", now=3.0)
    log.add("resp.new", 1, 1, b"new finish", now=10.0)
    log.add("resp.late", 0, 1, b"late 0", now=11.0)
    assert log.recent(9.0) == [("resp.new", b"new 0"), ("resp.new", b"new finish"), ("resp.late", b"late 0")]
    assert log.recent(12.0) == []
    assert len(log.recent(0.0)) == 5
    small = ReplayLog(max_streams=1)
    small.add("resp.a", 0, 1, b"a", now=1.0)
    small.add("resp.b", 0, 1, b"b", now=2.0)  # resp.a evicted, and forgotten as recent too
    assert small.recent(0.0) == [("resp.b", b"b")] and small.touched == {"resp.b": 2.0}
