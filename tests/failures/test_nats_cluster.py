"""The mesh on a 3-node NATS cluster (JetStream replicas = 3): one node killed with SIGKILL under steady
load loses no request and hangs none, and the node, started again, rejoins the cluster.

Its own mesh (a small sim cluster whose services list every node's URL), not the package's one.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import openai
import pytest

from hetmesh import servers, subjects
from hetmesh.cli.mesh import fetch_status
from hetmesh.launcher import Mesh

from ..clusters import cluster_toml, group, model
from ..e2e.conftest import running_mesh
from .conftest import expected_text

REQUESTS = 60
CONCURRENCY = 6
MAX_TOKENS = 40


def cluster_file(nats_url: str) -> str:
    return cluster_toml(
        mesh={"nats_url": nats_url, "time_scale": 0.5, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0,
              "stall_timeout_s": 20.0, "max_attempts": 3},
        work_queue={"replicas": 3},
        scheduler={"policy": "least_loaded"},
        models=[model("m", spec="tiny-llama", max_context=4096, block_size=16)],
        workers=[group("h100", "m", "nvidia-h100", role="both", count=2)])


@pytest.fixture(scope="module")
def nats_cluster() -> Iterator[servers.NatsCluster]:
    c = servers.start_nats_cluster(3)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster_mesh(nats_cluster: servers.NatsCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(Path(tmp_path_factory.mktemp("nats-cluster")), cluster_file(nats_cluster.url)) as m:
        yield m


def varz(monitor_port: int, path: str) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/{path}", timeout=2) as r:
        return json.loads(r.read())


async def rejoined(cluster: servers.NatsCluster, i: int) -> bool:
    """Node `i` has routes to both peers, and the work queue's replicas are all current, as seen from it
    (its JetStream API may not answer yet just after its start: not yet, then)."""
    if int(str(varz(cluster.monitor_ports[i], "routez").get("num_routes", 0))) < 2:
        return False
    try:
        nc = await nats.connect(cluster.nodes[i].url)
        try:
            info = await nc.jetstream(timeout=2).stream_info(subjects.WORK_STREAM)
        finally:
            await nc.close()
    except (nats.errors.Error, TimeoutError):
        return False
    peers = (info.cluster.replicas or []) if info.cluster else []
    return bool(info.cluster and info.cluster.leader) and len(peers) == 2 and all(p.current for p in peers)


async def one(client: openai.AsyncOpenAI, i: int) -> str:
    prompt = f"request {i} of the steady load"
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                             extra_body={"ignore_eos": True})
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == expected_text(prompt, MAX_TOKENS), f"request {i}: text differs"
    return text


async def test_one_nats_node_killed_under_load_loses_nothing(nats_cluster: servers.NatsCluster,
                                                            cluster_mesh: Mesh) -> None:
    # The stream is kept on all three nodes
    nc = await nats.connect(nats_cluster.url.split(","))
    info = await nc.jetstream().stream_info(subjects.WORK_STREAM)
    assert info.config.num_replicas == 3 and info.cluster is not None and len(info.cluster.replicas or []) == 2
    await nc.close()

    client = openai.AsyncOpenAI(base_url=f"{cluster_mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
    gate = asyncio.Semaphore(CONCURRENCY)
    done = 0
    quarter = asyncio.Event()
    took: list[float] = []

    async def bounded(i: int) -> str:
        nonlocal done
        async with gate:
            t0 = time.monotonic()
            out = await one(client, i)
            took.append(time.monotonic() - t0)
            done += 1
            if done >= REQUESTS // 4:
                quarter.set()
            return out

    tasks = [asyncio.create_task(bounded(i)) for i in range(REQUESTS)]
    await asyncio.wait_for(quarter.wait(), 60)
    victim = 0  # whichever node it is, some services and the stream's replicas are on it
    nats_cluster.kill(victim)
    killed_at = done
    # Every request ends, each with its full text: none lost, none hung (wait_for bounds the whole load)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert killed_at < REQUESTS  # the kill landed under load
    print(f"requests took {sorted(took)[len(took) // 2]:.2f} s at the median, {max(took):.2f} s at most")

    # Started again on its own store, it rejoins: routes to both peers and the stream's replica current again
    await asyncio.to_thread(nats_cluster.restart, victim)
    async with asyncio.timeout(30):
        while True:
            if await rejoined(nats_cluster, victim):
                break
            await asyncio.sleep(0.5)
    # and the mesh still serves; `hetmesh status` takes the cluster's URL list too
    assert await one(client, REQUESTS) == expected_text(f"request {REQUESTS} of the steady load", MAX_TOKENS)
    assert len((await fetch_status(nats_cluster.url, 5)).workers) == 2
