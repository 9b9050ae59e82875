"""Per-key rate limits shared by gateway replicas through a real redis-server: the Lua buckets agree
with the local ones, two gateways grant a key its limit once, and a Redis outage falls back to
per-gateway limits instead of failing requests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh import servers
from hetmesh.config import ApiKey, AuthConfig, MeshConfig, hash_key
from hetmesh.gateway.auth import Authenticator, KeyState, TokenBucket
from hetmesh.gateway.limits import PREFIX, SharedBuckets, bucket_key

from .conftest import FakePeer, GatewayProc, cluster_text, run_gateway


def key_state(rpm: int = 0, tpm: int = 0) -> tuple[str, KeyState]:
    """A fresh key (its own buckets, whatever Redis already holds) and its state."""
    key = "sk-" + secrets.token_hex(8)
    auth = Authenticator(AuthConfig(keys=[ApiKey(name="k", sha256=hash_key(key), rpm=rpm, tpm=tpm)]))
    v = auth.authenticate(f"Bearer {key}")
    assert v.key is not None
    return key, v.key


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


# (seconds since the last operation, amount, admit or charge)
ops = st.lists(st.tuples(st.floats(0, 90, allow_nan=False), st.integers(1, 400), st.booleans()), min_size=1,
               max_size=25)


@settings(max_examples=30, deadline=None)
@given(ops=ops, per_minute=st.sampled_from([3, 60, 250, 10_000]))
def test_the_lua_bucket_is_the_local_bucket(redis_url: str, ops: list[tuple[float, int, bool]],
                                            per_minute: int) -> None:
    # Driven with the same clock, the shared bucket and auth.TokenBucket give the same waits and levels
    # (to Lua's 14 significant digits of the stored clock).
    _, s = key_state(tpm=per_minute)
    local = TokenBucket(float(per_minute))

    async def go() -> None:
        shared = SharedBuckets(aioredis.from_url(redis_url, decode_responses=True))
        try:
            t = 1_000_000.0
            for dt, n, admit in ops:
                t += dt
                key = bucket_key(s, "tokens")
                if admit:
                    want = local.wait_s(n, t)
                    if want <= 0:
                        local.take(n, t)
                    got = await shared._call("admit", [(key, per_minute, n)], repr(t))
                    assert got is not None and got[0] == pytest.approx(want, abs=1e-3)
                else:
                    local.take(n, t)
                    got = await shared._call("charge", [(key, per_minute, n)], repr(t))
                    assert got is not None
                assert got[1] == pytest.approx(local.level, abs=1e-3)
        finally:
            await shared.close()

    run(go())


def test_two_gateways_share_one_limit(redis_url: str) -> None:
    _, s = key_state(rpm=3, tpm=1000)

    async def go() -> None:
        a = SharedBuckets(aioredis.from_url(redis_url, decode_responses=True))
        b = SharedBuckets(aioredis.from_url(redis_url, decode_responses=True))
        try:
            granted = [await gw.take(s, 10, 0.0) for gw in (a, b, a)]
            assert all(t.wait_s == 0 for takes in granted for t in takes)
            assert [t.remaining for t in granted[-1]] == [0, 1000 - 30]
            refused = await b.take(s, 10, 0.0)
            assert refused[0].kind == "requests" and 0 < refused[0].wait_s <= 20  # one request per 20 s
            assert refused[1].wait_s == 0 and refused[1].remaining == 970  # all or nothing: no tokens taken
            await a.charge(s, 5000, 0.0)  # a completion puts the key in debt, seen by the other replica
            after = await b.take(s, 10, 0.0)
            assert after[1].wait_s > 0
            ttl = await a.client.ttl(bucket_key(s, "tokens"))
            # kept until it would be full again: from -4030 back to 1000 at 1000 a minute is 301.8 s
            assert 300 < ttl <= 303
            assert a.fallbacks == b.fallbacks == 0
            assert all(k.startswith(PREFIX) for k in await a.client.keys(f"{PREFIX}*"))
        finally:
            await a.close()
            await b.close()

    run(go())


def test_redis_down_falls_back_to_the_gateways_own_buckets() -> None:
    _, s = key_state(rpm=2)

    async def go() -> None:
        dead = SharedBuckets(aioredis.from_url(f"redis://127.0.0.1:{servers.free_port()}/0", decode_responses=True,
                                               socket_connect_timeout=0.5))
        try:
            # never saw the shared bucket: the local one starts empty (the other replicas may have spent it)
            assert (await dead.take(s, 1, 0.0))[0].wait_s > 0
            assert dead.fallbacks == 1 and dead.down_until > 0
            assert [t.wait_s for t in await dead.take(s, 1, 30.0)] == [0]  # refilled: one request per 30 s
            assert (await dead.take(s, 1, 31.0))[0].wait_s > 0  # still limited: per gateway, no Redis call
            assert dead.fallbacks == 3
        finally:
            await dead.close()

    run(go())


@pytest.mark.mesh  # its own redis-server
def test_a_fallback_starts_from_the_shared_state_last_seen() -> None:
    _, s = key_state(rpm=5)
    rs = servers.start_redis()

    async def go() -> None:
        gw = SharedBuckets.from_mesh(MeshConfig(redis_url=rs.url))
        assert gw is not None
        try:
            assert [(await gw.take(s, 1, 0.0))[0].wait_s for _ in range(5)] == [0] * 5
            rs.stop()  # the shared bucket is empty; the local one must not start full
            refused = await gw.take(s, 1, 0.0)
            assert gw.fallbacks == 1 and refused[0].wait_s > 0 and refused[0].remaining == 0
        finally:
            await gw.close()

    try:
        run(go())
    finally:
        rs.stop()


def test_a_burst_waits_for_the_pool_and_grants_the_limit_once(redis_url: str) -> None:
    """Many more concurrent admissions than the pool has connections: they queue for a connection
    (none falls back to a local bucket) and the key gets exactly its limit."""
    _, s = key_state(rpm=20)

    async def go() -> None:
        gw = SharedBuckets.from_mesh(MeshConfig(redis_url=redis_url))
        assert gw is not None
        try:
            takes = await asyncio.gather(*(gw.take(s, 1, 0.0) for _ in range(150)))
            assert sum(t[0].wait_s == 0 for t in takes) == 20
            assert gw.fallbacks == 0
        finally:
            await gw.close()

    run(go())


@pytest.fixture(scope="module")
def two_gateways(gw_nats: str, peer: FakePeer, redis_url: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, GatewayProc, GatewayProc]]:
    key = "sk-" + secrets.token_hex(8)
    auth = f'[[auth.keys]]\nname = "shared"\nsha256 = "{hash_key(key)}"\nrpm = 3\n'
    toml = cluster_text("", auth)
    with (run_gateway(gw_nats, tmp_path_factory.mktemp("gwa"), "gwa", cluster_toml=toml,
                      HETMESH_REDIS_URL=redis_url) as a,
          run_gateway(gw_nats, tmp_path_factory.mktemp("gwb"), "gwb", cluster_toml=toml,
                      HETMESH_REDIS_URL=redis_url) as b):
        yield key, a, b


def test_a_key_gets_its_limit_once_across_gateway_processes(two_gateways: tuple[str, GatewayProc, GatewayProc]
                                                             ) -> None:
    key, a, b = two_gateways

    def chat(gw: GatewayProc) -> str:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=20)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        return r.choices[0].message.content or ""

    assert [chat(gw) for gw in (a, b, a)] == ["abcd"] * 3
    for gw in (b, a):
        with pytest.raises(openai.RateLimitError) as e:
            chat(gw)
        assert e.value.code == "rate_limit_exceeded"
        assert e.value.response.headers["x-ratelimit-remaining-requests"] == "0"


@pytest.fixture(scope="module")
def rpm20(gw_nats: str, peer: FakePeer, redis_url: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, GatewayProc]]:
    key = "sk-" + secrets.token_hex(8)
    toml = cluster_text("", f'[[auth.keys]]\nname = "burst"\nsha256 = "{hash_key(key)}"\nrpm = 20\n')
    with run_gateway(gw_nats, tmp_path_factory.mktemp("gw20"), "gw20", cluster_toml=toml,
                     HETMESH_REDIS_URL=redis_url) as gw:
        yield key, gw


def test_a_burst_of_concurrent_requests_gets_the_limit_once(rpm20: tuple[str, GatewayProc]) -> None:
    key, gw = rpm20
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def go() -> tuple[list[int], float]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=gw.url, limits=limits, timeout=60,
                                     headers={"authorization": f"Bearer {key}"}) as http:
            t0 = time.monotonic()
            rs = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(150)))
            return [r.status_code for r in rs], time.monotonic() - t0

    codes, took = run(go())
    assert set(codes) <= {200, 429}, codes
    # the bucket refills 20 a minute: a burst that took t seconds may get t / 3 more
    assert 20 <= codes.count(200) <= 20 + int(took * 20 / 60), (codes.count(200), took)
    assert "limiting per gateway" not in gw.log.read_text()


@pytest.fixture(scope="module")
def two_gateways_rpm20(gw_nats: str, peer: FakePeer, redis_url: str,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, GatewayProc, GatewayProc]]:
    key = "sk-" + secrets.token_hex(8)
    toml = cluster_text("", f'[[auth.keys]]\nname = "burst2"\nsha256 = "{hash_key(key)}"\nrpm = 20\n')
    with (run_gateway(gw_nats, tmp_path_factory.mktemp("gw20a"), "gw20a", cluster_toml=toml,
                      HETMESH_REDIS_URL=redis_url) as a,
          run_gateway(gw_nats, tmp_path_factory.mktemp("gw20b"), "gw20b", cluster_toml=toml,
                      HETMESH_REDIS_URL=redis_url) as b):
        yield key, a, b


@dataclasses.dataclass
class RawResponse:
    status_code: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def raw_post(url: str, path: str, body: bytes, headers: dict[str, str], start: asyncio.Event) -> RawResponse:
    """One POST on its own connection, written and read with asyncio streams: a thousand of them cost the
    test's process far less than an HTTP client would (the gateways are what is measured)."""
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    await start.wait()
    writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(body)}\r\n{head}\r\n".encode() + body)
    raw = await reader.read()
    writer.close()
    top, _, rest = raw.partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    hs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return RawResponse(int(lines[0].split()[1]), hs, rest)


def test_a_burst_of_1000_across_two_gateways_admits_the_limit_once(
        two_gateways_rpm20: tuple[str, GatewayProc, GatewayProc]) -> None:
    key, a, b = two_gateways_rpm20
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()

    async def go() -> tuple[list[RawResponse], float]:
        start = asyncio.Event()
        tasks = [asyncio.ensure_future(raw_post(gw.url, "/v1/chat/completions", body,
                                                {"authorization": f"Bearer {key}"}, start))
                 for _ in range(500) for gw in (a, b)]
        await asyncio.sleep(1.0)  # every connection open, then all requests at once
        t0 = time.monotonic()
        start.set()
        rs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        return rs, time.monotonic() - t0

    rs, took = run(go())
    codes = [r.status_code for r in rs]
    assert len(rs) == 1000 and set(codes) <= {200, 429}, sorted(set(codes))
    ok = [r for r in rs if r.status_code == 200]
    # a minute's allowance, plus what the bucket refilled (one per 3 s) while the burst lasted
    assert 20 <= len(ok) <= 20 + int(took * 20 / 60), (len(ok), took)
    assert all(r.json()["choices"][0]["message"]["content"] == "ab" for r in ok)
    if len(ok) == 20:  # admitted one at a time against the one shared bucket: remaining 19, 18, ..., 0
        assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok) == list(range(20))
    assert all(r.headers["x-ratelimit-limit-requests"] == "20" for r in rs)
    refused = [r for r in rs if r.status_code == 429]
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
               for r in refused)
    for gw in (a, b):
        assert gw.alive
        assert "limiting per gateway" not in gw.log.read_text()
    print(f"1000 concurrent requests, rpm 20, 2 gateways: {len(ok)} admitted in {took:.2f} s")
