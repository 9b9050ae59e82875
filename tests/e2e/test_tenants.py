"""Flow control through the real gateway and scheduler: two tenants named by the tenant header; one floods a
one-worker mesh with long prompts, the other is still served; an unknown tenant gets 400 naming the header."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from hetmesh.launcher import Mesh

from ..clusters import cluster_toml, group, model
from .conftest import EventLog, collect_events, running_mesh

CLUSTER = cluster_toml(
    mesh={"time_scale": 0.5, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0},
    scheduler={"policy": "cost", "ttft_slo_s": 2.0, "tpot_slo_s": 0.2},
    flow={"bands": ["default"], "max_held": 8},
    tenants=[{"name": "flood"}, {"name": "quiet"}],
    models=[model("m", spec="llama-3.1-8b", max_context=32768, block_size=16)],
    workers=[group("a", "m", "nvidia-h100", role="both", max_batch=8)])


@pytest.fixture(scope="module")
def tenants_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("tenants"), CLUSTER) as m:
        yield m


async def _ask(c: httpx.AsyncClient, tenant: str, prompt: str, max_tokens: int) -> httpx.Response:
    return await c.post("/v1/completions", headers={"x-hetmesh-tenant": tenant},
                        json={"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


async def test_a_flooding_tenant_does_not_starve_the_other(tenants_mesh: Mesh) -> None:
    async for log in collect_events(tenants_mesh.nats_url):
        # The client waits past the gateway's stall timeout (60 s): a stream that goes silent is the gateway's
        # to answer, and a request that gets no answer at all fails with its events printed.
        async with httpx.AsyncClient(base_url=tenants_mesh.url, timeout=90) as c:
            flood = [asyncio.create_task(_ask(c, "flood", "x " * 6000, 64)) for _ in range(80)]
            await asyncio.sleep(0.5)
            quiet = [await _served(c, "quiet", f"hello {i}", 8) for i in range(6)]
            floods = await asyncio.gather(*flood, return_exceptions=True)
            lost = [r for r in floods if not isinstance(r, httpx.Response)]
            assert not lost, f"{lost!r}\n{_unfinished(log)}"
            assert [r.status_code for r in quiet] == [200] * 6, [r.text for r in quiet]
            codes = [r.status_code for r in floods]  # type: ignore[union-attr]
            assert set(codes) <= {200, 429} and 200 in codes, f"{codes}\n{_unfinished(log)}"
            for r in floods:
                if r.status_code == 429:  # type: ignore[union-attr]
                    assert int(r.headers["retry-after"]) >= 1  # type: ignore[union-attr]
            status = (await c.get("/ready")).json()
            assert status


async def _served(c: httpx.AsyncClient, tenant: str, prompt: str, max_tokens: int) -> httpx.Response:
    """A client that retries a 429 after its Retry-After, twice at most. The flood's first burst may hold the fleet
    to the edge of its SLOs before the quiet tenant has sent anything (the fleet is not preemptive): its first
    request may be refused, with a Retry-After that its next try meets."""
    for _ in range(2):
        r = await _ask(c, tenant, prompt, max_tokens)
        if r.status_code != 429:
            return r
        await asyncio.sleep(int(r.headers["retry-after"]))
    return await _ask(c, tenant, prompt, max_tokens)


def _unfinished(log: EventLog) -> str:
    """The events of each request that was placed and never finished, in order."""
    by: dict[str, list[str]] = {}
    for e in sorted(log.events, key=lambda e: e.ts):
        by.setdefault(e.request_id, []).append(f"{e.ts:.3f} {e.instance} {e.kind} {e.detail}")
    return "\n".join(f"{rid}:\n  " + "\n  ".join(lines) for rid, lines in by.items()
                     if any(" placed " in x for x in lines) and not any(" finished " in x for x in lines))


async def test_an_unknown_tenant_is_a_400_naming_the_header(tenants_mesh: Mesh) -> None:
    async with httpx.AsyncClient(base_url=tenants_mesh.url, timeout=30) as c:
        r = await _ask(c, "nobody", "hi", 2)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-hetmesh-tenant"
        assert (await _ask(c, "quiet", "hi", 2)).status_code == 200


def test_the_scheduler_shares_the_fleet_by_tenant(tenants_mesh: Mesh) -> None:
    """Flow control is on in the live scheduler when the cluster file names [[tenants]]: each tenant that sent
    a request shows in its status (`hetmesh status --tenants --json`)."""
    with httpx.Client(base_url=tenants_mesh.url, timeout=30) as c:
        for tenant in ("flood", "quiet"):
            r = c.post("/v1/completions", headers={"x-hetmesh-tenant": tenant},
                       json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
    r = subprocess.run([sys.executable, "-m", "hetmesh.cli", "status", "--nats", tenants_mesh.nats_url, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tenants = json.loads(r.stdout)["tenants"]
    assert {"flood", "quiet"} <= set(tenants), tenants
