"""NATS and Redis credentials "by config": a real nats-server started with user/password and a real
redis-server with requirepass; the services' own connect paths (Bus.for_mesh, PrefixIndex.for_mesh)
get in with the cluster file's (or the environment's) credentials and are refused without them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.exceptions

from hetmesh import config, servers
from hetmesh.bus import Bus
from hetmesh.config import MeshConfig
from hetmesh.kvindex.index import PrefixIndex
from hetmesh.protocol import Cancel, KvEvent


@pytest.fixture(scope="module")
def secured() -> Iterator[tuple[str, str]]:
    nats_srv = servers.start_nats(user="mesh", password="s3cret-nats")
    redis_srv = servers.start_redis(password="s3cret-redis")
    try:
        yield nats_srv.url, redis_srv.url
    finally:
        nats_srv.stop()
        redis_srv.stop()


async def test_nats_user_password_from_config(secured: tuple[str, str]) -> None:
    mesh = MeshConfig(nats_url=secured[0], nats_user="mesh", nats_password="s3cret-nats")
    bus = await Bus.for_mesh(mesh, "cred-test")
    got: asyncio.Queue[Cancel] = asyncio.Queue()

    async def on_cancel(c: Cancel, _m: object) -> None:
        await got.put(c)

    await bus.subscribe("hetmesh.cancel", Cancel, on_cancel)
    await bus.publish("hetmesh.cancel", Cancel(request_id="r1"))
    assert (await asyncio.wait_for(got.get(), 5)).request_id == "r1"
    await bus.close()


async def test_nats_wrong_or_no_password_is_refused(secured: tuple[str, str]) -> None:
    for opts in ({}, config.nats_options(MeshConfig(nats_user="mesh", nats_password="wrong"))):
        with pytest.raises(Exception, match=r"(?i)authoriz|no servers"):
            # long enough under load for the server's refusal to arrive (else the error only says "no answer")
            await Bus.connect(secured[0], "intruder", connect_timeout_s=5.0, **opts)


async def test_redis_password_from_config(secured: tuple[str, str]) -> None:
    idx = PrefixIndex.for_mesh(MeshConfig(redis_url=secured[1], redis_password="s3cret-redis"), ttl_s=30)
    await idx.apply(KvEvent(worker_id="w0", model="m", stored=[1, 2, 3]))
    assert await idx.lookup("m", [1, 2, 3]) == {"w0": 3}
    await idx.close()
    bare = PrefixIndex.for_mesh(MeshConfig(redis_url=secured[1]), ttl_s=30)
    with pytest.raises(redis.exceptions.AuthenticationError):
        await bare.lookup("m", [1])
    await bare.close()


def test_credentials_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMESH_NATS_USER", "mesh")
    monkeypatch.setenv("HETMESH_NATS_PASSWORD", "pw")
    monkeypatch.setenv("HETMESH_REDIS_PASSWORD", "rpw")
    cfg = config.load()
    assert config.nats_options(cfg.mesh) == {"user": "mesh", "password": "pw"}
    assert config.redis_connection(cfg.mesh)[1] == {"password": "rpw"}
    cfg.mesh.redis_url, cfg.mesh.redis_tls_ca_file = "redis://h:1/0", "/ca.pem"
    assert config.redis_connection(cfg.mesh) == ("rediss://h:1/0", {"password": "rpw", "ssl_ca_certs": "/ca.pem"})
