"""A whole mesh (scheduler, kv-transfer, workers, gateway as separate processes) for e2e tests.

One mesh serves two models so one set of processes covers both placements:
  tiny-agg  on two aggregated H100 workers (prefix_aware picks between them)
  tiny-pd   on a Rubin CPX prefill worker and a Rubin VR200 decode worker (disaggregated)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import openai
import pytest

from hetmesh import subjects
from hetmesh.bus import decode_events
from hetmesh.launcher import Mesh
from hetmesh.protocol import ServiceEvent

from ..clusters import cluster_toml, group, model

# Slow enough that a long generation takes seconds (cancel / kill tests), fast enough for CI.
TIME_SCALE = 0.5
CLUSTER = cluster_toml(
    mesh={"time_scale": TIME_SCALE, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0, "stall_timeout_s": 20.0},
    scheduler={"policy": "prefix_aware"},
    models=[model("tiny-agg", spec="tiny-llama", max_context=4096, block_size=16),
            model("tiny-pd", spec="tiny-llama", max_context=4096, block_size=16)],
    workers=[group("h100", "tiny-agg", "nvidia-h100", role="both", count=2),
             group("cpx", "tiny-pd", "nvidia-rubin-cpx", role="prefill"),
             group("vr200", "tiny-pd", "nvidia-rubin-vr200", role="decode")])


@contextlib.contextmanager
def running_mesh(d: Path, cluster: str, ready_timeout_s: float = 90, **kw: object) -> Iterator[Mesh]:
    """A Mesh of `cluster` (TOML text) with its own nats-server and redis-server, logs under `d`
    (their tails printed at the end)."""
    path = d / "cluster.toml"
    path.write_text(cluster)
    m = Mesh(path, gateway_port=0, log_dir=d / "logs", **kw)  # type: ignore[arg-type]
    try:  # stopped however it ends, even interrupted while it starts
        m.start(ready_timeout_s=ready_timeout_s)
        yield m
    finally:
        m.stop()
        print_logs_on_failure(d / "logs")


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # Its own nats-server and redis-server: other tests' schedulers and workers must not join.
    with running_mesh(tmp_path_factory.mktemp("mesh"), CLUSTER) as m:
        yield m


def print_logs_on_failure(log_dir: Path) -> None:
    for f in sorted(log_dir.glob("*.log")):
        tail = f.read_text(errors="replace").splitlines()[-15:]
        print(f"--- {f.name}\n" + "\n".join(tail))


@pytest.fixture(scope="session")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def aclient(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)


class EventLog:
    """Every ServiceEvent the services publish, collected from `hetmesh.event.>`."""

    def __init__(self) -> None:
        self.events: list[ServiceEvent] = []

    async def on_msg(self, m: object) -> None:
        self.events.extend(decode_events(m.data))  # type: ignore[attr-defined]

    def for_request(self, rid: str) -> list[ServiceEvent]:
        """Events of one request ("" matches any request's)."""
        return [e for e in self.events if e.request_id and (not rid or e.request_id == rid or rid.endswith(e.request_id))]

    async def wait_for(self, rid: str, kind: str, timeout_s: float = 10.0, **detail: object) -> ServiceEvent:
        async with asyncio.timeout(timeout_s):
            while True:
                for e in self.for_request(rid):
                    if e.kind == kind and all(e.detail.get(k) == v for k, v in detail.items()):
                        return e
                await asyncio.sleep(0.02)


async def collect_events(nats_url: str) -> AsyncIterator[EventLog]:
    """An EventLog filled from `hetmesh.event.>` while the generator is open (reconnects on its own)."""
    nc = await nats.connect(nats_url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)  # a cluster too
    log = EventLog()
    await nc.subscribe(subjects.EVENTS_ALL, cb=log.on_msg)
    await nc.flush()
    try:
        yield log
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


@pytest.fixture
async def events(mesh: Mesh) -> AsyncIterator[EventLog]:
    async for log in collect_events(mesh.nats_url):
        yield log

