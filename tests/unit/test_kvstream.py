"""The KV stream (hetmesh.kvstream) over real loopback sockets: bytes land exactly, the secret is
checked, and no byte sequence a peer can send makes the receiver take a transfer or stop serving."""

from __future__ import annotations

import asyncio
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.kvpeer import answer_to

from hetmesh import kvstream
from hetmesh.protocol import KvTransferRequest

SECRET = b"s3cret"


class Buffer:
    def __init__(self, n: int) -> None:
        self.buf = bytearray(n)
        self.view: memoryview | None = memoryview(self.buf)
        self.state = "open"

    def commit(self) -> None:
        self.state = "committed"

    def discard(self) -> None:
        self.state = "discarded"


def header(nbytes: int, dst: str = "dec") -> KvTransferRequest:
    return KvTransferRequest(transfer_id="t1", request_id="r1", model="m", src_worker="pre", dst_worker=dst,
                             num_tokens=3, nbytes=nbytes, chunk_bytes=0, first_token_ids=[7])


class Failed(list[str]):
    def __init__(self) -> None:
        super().__init__()
        self.event = asyncio.Event()


async def with_receiver(body, secret: bytes = SECRET):  # type: ignore[no-untyped-def]
    landed: list[tuple[KvTransferRequest, Buffer]] = []
    failed = Failed()
    sinks: list[Buffer] = []

    def open_sink(h: KvTransferRequest) -> Buffer:
        sinks.append(Buffer(h.nbytes))
        return sinks[-1]

    async def on_landed(h: KvTransferRequest, sink: kvstream.KvSink, _s: float) -> None:
        assert isinstance(sink, Buffer)
        landed.append((h, sink))

    async def on_failed(_h: KvTransferRequest, why: str) -> None:
        failed.append(why)
        failed.event.set()

    r = kvstream.Receiver("dec", open_sink, on_landed, on_failed, idle_timeout_s=2.0, secret=secret)
    endpoint = await r.start("127.0.0.1", 0)
    try:
        await body(endpoint, landed, failed, sinks)
    finally:
        await r.close()


def test_bytes_land_exactly_and_a_refusal_is_an_error() -> None:
    async def body(endpoint, landed, failed, sinks):  # type: ignore[no-untyped-def]
        data = os.urandom(3 << 20)
        await kvstream.send(endpoint, header(len(data)), data, secret=SECRET)
        assert len(landed) == 1 and bytes(landed[0][1].buf) == data and landed[0][0].first_token_ids == [7]
        await kvstream.send(endpoint, header(5 << 20), None, secret=SECRET)  # a sim engine's zeros
        assert bytes(landed[1][1].buf) == bytes(5 << 20)
        for wrong in (dict(secret=b""), dict(secret=b"other")):
            try:
                await kvstream.send(endpoint, header(10), b"0123456789", **wrong)  # type: ignore[arg-type]
            except ConnectionError as exc:
                assert "refused" in str(exc)
            else:
                raise AssertionError("a sender without the secret got its KV in")
        assert len(landed) == 2 and not failed

    asyncio.run(with_receiver(body))


def test_a_stream_cut_short_fails_and_frees_its_sink() -> None:
    async def body(endpoint, landed, failed, sinks):  # type: ignore[no-untyped-def]
        host, port = kvstream.split_endpoint(endpoint)
        _, w = await asyncio.open_connection(host, port)
        w.write(kvstream.frame_header(header(1 << 20), SECRET) + bytes(1000))
        await w.drain()
        w.close()
        await asyncio.wait_for(failed.event.wait(), 5)
        assert "broke off" in failed[0] and not landed and sinks[0].state == "discarded"

    asyncio.run(with_receiver(body))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=300),
    st.builds(lambda n, rest: n.to_bytes(4, "big") + rest, st.integers(0, 2**32 - 1), st.binary(max_size=200)),
    st.builds(lambda h, tail: kvstream.frame_header(h) + tail,
              st.builds(header, st.integers(-5, 1 << 16), st.sampled_from(["dec", "other"])), st.binary(max_size=64)),
))
def test_no_bytes_from_a_stranger_get_in(junk: bytes) -> None:
    async def body(endpoint, landed, failed, sinks):  # type: ignore[no-untyped-def]
        answer = await answer_to(*kvstream.split_endpoint(endpoint), junk, 5)
        assert answer in (b"", kvstream.ACK_REFUSED) and not landed
        # ...and the port still takes a real transfer.
        await kvstream.send(endpoint, header(100), bytes(range(100)), secret=SECRET)
        assert len(landed) == 1 and bytes(landed[0][1].buf) == bytes(range(100))

    asyncio.run(with_receiver(body))
