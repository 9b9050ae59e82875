"""The live mesh learns each worker's speed from its engine's steps: one of three identical sim workers really
runs 3x slower than its catalog prior; the scheduler finds out from heartbeats, prices it so, raises the
degraded alarm, and `hetmesh status` shows it."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest

from hetmesh.launcher import Mesh
from hetmesh.metrics import scrape

from ..clusters import cluster_toml, group, model
from .conftest import collect_events, running_mesh

CLUSTER = cluster_toml(
    mesh={"time_scale": 1.0, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0},
    scheduler={"policy": "cost", "admission_margin": 0.0},
    models=[model("tiny", spec="tiny-llama", max_context=4096, block_size=16)],
    workers=[group("fast", "tiny", "nvidia-h100", count=2),
             group("slow", "tiny", "nvidia-h100", sim_slowdown=3.0)])


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("learning"), CLUSTER) as m:
        yield m


def _cli(mesh: Mesh, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "hetmesh.cli", "status", "--nats", mesh.nats_url, *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


async def _status(mesh: Mesh) -> dict[str, dict[str, object]]:
    out = await asyncio.to_thread(_cli, mesh, "--json")
    return {w["worker_id"]: w for w in json.loads(out)["details"]}


async def test_a_slow_worker_is_learned_and_flagged(mesh: Mesh) -> None:
    client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> None:
        r = await client.completions.create(model="tiny", prompt=f"request {i} " + "word " * (50 + 40 * (i % 7)),
                                            max_tokens=48, seed=i)
        assert r.usage is not None and r.usage.completion_tokens > 0

    async for events in collect_events(mesh.nats_url):
        for burst in range(6):
            await asyncio.gather(*(one(8 * burst + i) for i in range(8)))
        for _ in range(50):  # until every worker has reported steps and the alarm is up
            st = await _status(mesh)
            if all(w["fitted_steps"] for w in st.values()) and st["slow-0"]["degraded"]:
                break
            await asyncio.sleep(0.2)
        assert st["slow-0"]["speed"] == pytest.approx(1 / 3, rel=0.25), st["slow-0"]
        assert 0 < st["slow-0"]["speed_rel_std"] < 0.2, st["slow-0"]
        for wid in ("fast-0", "fast-1"):
            assert st[wid]["speed"] == pytest.approx(1.0, rel=0.15) and not st[wid]["degraded"], st[wid]
        assert st["slow-0"]["degraded"] and st["slow-0"]["vs_peers"] > 2.0
        for _ in range(50):  # the scheduler's event batch reaches the bus within a flush interval
            if any(e.kind == "worker_degraded" and e.detail.get("worker_id") == "slow-0" for e in events.events):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("no worker_degraded event for slow-0")
        break
    samples = scrape(mesh.metrics_urls()["scheduler"])
    speed = {dict(k[1])["worker"]: v for k, v in samples.items() if k[0] == "hetmesh_scheduler_worker_speed"}
    assert speed["slow-0"] < 0.5 < speed["fast-0"]
    assert samples[("hetmesh_scheduler_worker_degraded", (("worker", "slow-0"),))] == 1.0
    table = await asyncio.to_thread(_cli, mesh)
    row = next(ln for ln in table.splitlines() if " slow-0 " in ln)
    assert re.search(r"x0\.[234]\d ±\d+%", row) and "degraded" in row, row  # about a third of its prior


async def test_calibrate_saves_what_the_scheduler_learned(mesh: Mesh, tmp_path) -> None:
    from hetmesh.costmodel.efficiency import load_efficiencies

    for _ in range(50):  # the first test (or this one alone) needs every worker fitted
        st = await _status(mesh)
        if st and all(w["fitted_steps"] for w in st.values()):
            break
        await asyncio.sleep(0.2)
    out = tmp_path / "eff.json"
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "hetmesh.cli", "calibrate", "--nats",
                                                 mesh.nats_url, "--out", str(out)], capture_output=True, text=True,
                                timeout=60)
    if not all(w["fitted_steps"] for w in st.values()):
        assert r.returncode == 2 and "no worker" in r.stderr
        pytest.skip("no traffic has reached the workers in this run")
    assert r.returncode == 0, r.stderr
    effs = load_efficiencies(out)
    assert set(effs) == {"nvidia-h100/tiny-llama"}
    saved = json.loads(out.read_text())["nvidia-h100/tiny-llama"]
    assert saved["samples"] == sum(w["fitted_steps"] for w in st.values())
    out.write_text("{not json")
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "hetmesh.cli", "calibrate", "--nats",
                                                 mesh.nats_url, "--out", str(out)], capture_output=True, text=True,
                                timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and str(out) in r.stderr, r.stderr
