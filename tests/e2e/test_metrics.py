"""Prometheus /metrics on the gateway and on every other service's own HTTP port, scraped from the
real processes of the e2e mesh after real requests (deltas: the mesh is shared with other tests)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from hetmesh.costmodel import accelerator
from hetmesh.launcher import Mesh
from hetmesh.metrics import Samples, scrape

ROOT = Path(__file__).resolve().parents[2]


def scrape_all(mesh: Mesh) -> dict[str, Samples]:
    return {name: scrape(url) for name, url in mesh.metrics_urls().items()}


def val(s: Samples, name: str, **labels: str) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


def test_every_service_serves_metrics_health_and_ready(mesh: Mesh) -> None:
    for name, svc in mesh.services.items():
        if svc.metrics_port is None:
            continue
        base = f"http://127.0.0.1:{svc.metrics_port}"
        assert httpx.get(f"{base}/health", timeout=5).json() == {"status": "ok"}, name
        ready = httpx.get(f"{base}/ready", timeout=5)
        assert ready.status_code == 200 and ready.json()["ready"] is True, (name, ready.text)
        assert httpx.get(f"{base}/nope", timeout=5).status_code == 404


def quiet(mesh: Mesh, timeout_s: float = 30.0) -> dict[str, Samples]:
    """Scrape once nothing is running anywhere: earlier tests' requests must not land in the deltas."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = scrape_all(mesh)
        busy = val(s["gateway"], "hetmesh_gateway_requests_in_flight") + sum(
            val(v, "hetmesh_worker_running_requests") + val(v, "hetmesh_worker_queue_depth")
            for k, v in s.items() if k.startswith("worker:"))
        if busy == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def test_requests_show_up_in_every_services_metrics(mesh: Mesh, client: openai.OpenAI) -> None:
    before = quiet(mesh)
    agg = client.completions.create(model="tiny-agg", prompt="metrics " * 8, max_tokens=7)
    assert agg.usage.completion_tokens == 7
    pd = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-pd", prompt="disaggregated metrics " * 8, max_tokens=5, stream=True))
    assert pd
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError:
        pass
    # Workers' records arrive a few ms after the client's last token.
    deadline = time.monotonic() + 10
    while True:
        after = scrape_all(mesh)
        kvx = after["kv-transfer-0"]
        if (val(kvx, "hetmesh_kv_transfer_transfers_total", result="ok")
                > val(before["kv-transfer-0"], "hetmesh_kv_transfer_transfers_total", result="ok")
                and val(after["worker:vr200-0"], "hetmesh_worker_requests_total", phase="decode", finish_reason="length")
                > val(before["worker:vr200-0"], "hetmesh_worker_requests_total", phase="decode",
                      finish_reason="length")) or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def delta(svc: str, name: str, **labels: str) -> float:
        return val(after[svc], name, **labels) - val(before[svc], name, **labels)

    gw = "gateway"
    assert delta(gw, "hetmesh_gateway_requests_total", model="tiny-agg", status="200") == 1
    assert delta(gw, "hetmesh_gateway_requests_total", model="tiny-pd", status="200") == 1
    assert delta(gw, "hetmesh_gateway_requests_total", model="", status="404") == 1
    for m in ("tiny-agg", "tiny-pd"):
        assert delta(gw, "hetmesh_gateway_time_to_first_token_seconds_count", model=m) == 1
        assert delta(gw, "hetmesh_gateway_time_per_output_token_seconds_count", model=m) == 1
        assert delta(gw, "hetmesh_gateway_request_duration_seconds_count", model=m) == 1
    assert delta(gw, "hetmesh_gateway_completion_tokens_total", model="tiny-agg") == 7
    assert val(after[gw], "hetmesh_gateway_requests_in_flight") == 0

    s = "scheduler"
    assert delta(s, "hetmesh_scheduler_placements_total", policy="prefix_aware", mode="aggregated") == 1
    assert delta(s, "hetmesh_scheduler_placements_total", policy="prefix_aware", mode="disaggregated") == 1
    assert delta(s, "hetmesh_scheduler_placement_duration_seconds_count") == 2
    roles = {r: val(after[s], "hetmesh_scheduler_workers", role=r) for r in ("both", "prefill", "decode")}
    assert roles == {"both": 2, "prefill": 1, "decode": 1}
    # $/hour of the live fleet at the catalog's prices: one device per worker here
    price = {a: accelerator(a).usd_per_hour for a in ("nvidia-h100", "nvidia-rubin-cpx", "nvidia-rubin-vr200")}
    assert val(after[s], "hetmesh_fleet_usd_per_hour", model="tiny-agg", accelerator="nvidia-h100") == pytest.approx(
        2 * price["nvidia-h100"])
    assert val(after[s], "hetmesh_fleet_usd_per_hour", model="tiny-pd", accelerator="nvidia-rubin-vr200") == \
        pytest.approx(price["nvidia-rubin-vr200"])

    h100 = [f"worker:h100-{i}" for i in range(2)]
    assert sum(delta(w, "hetmesh_worker_requests_total", phase="full", finish_reason="length") for w in h100) == 1
    assert sum(delta(w, "hetmesh_worker_generated_tokens_total") for w in h100) == 7
    assert sum(delta(w, "hetmesh_worker_prompt_tokens_computed_total")
               + delta(w, "hetmesh_worker_prompt_tokens_cached_total") for w in h100) == agg.usage.prompt_tokens
    for phase in ("queue", "prefill", "decode"):
        assert sum(delta(w, "hetmesh_worker_phase_duration_seconds_count", phase=phase) for w in h100) == 1, phase
    for w in (*h100, "worker:cpx-0", "worker:vr200-0"):
        assert val(after[w], "hetmesh_worker_kv_blocks_total") > 0, w
        assert val(after[w], "hetmesh_worker_kv_blocks_used") <= val(after[w], "hetmesh_worker_kv_blocks_total")
        for g in ("hetmesh_worker_queue_depth", "hetmesh_worker_running_requests"):
            assert (g, ()) in after[w], (w, g)

    sent = delta("worker:cpx-0", "hetmesh_worker_kv_transfer_sent_bytes_total")
    assert sent > 0
    assert delta("kv-transfer-0", "hetmesh_kv_transfer_bytes_total") == sent
    assert delta("kv-transfer-0", "hetmesh_kv_transfer_duration_seconds_count") == 1
    assert delta("worker:vr200-0", "hetmesh_worker_kv_transfer_received_bytes_total") == sent
    assert delta("worker:vr200-0", "hetmesh_worker_phase_duration_seconds_count", phase="kv_wait") == 1
    assert delta("worker:vr200-0", "hetmesh_worker_time_per_output_token_seconds_count", source="observed") == 1


def test_the_grafana_dashboard_only_queries_metrics_the_services_export(mesh: Mesh, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny-pd", prompt="dashboard " * 8, max_tokens=3)
    exported = {name for samples in scrape_all(mesh).values() for name, _ in samples}
    dash = json.loads((ROOT / "ops" / "grafana" / "dashboards" / "hetmesh.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\bhetmesh_[a-z0-9_]+", e)}
    assert len(used) >= 20
    assert used <= exported, sorted(used - exported)
    assert len({p["gridPos"]["x"] + 100 * p["gridPos"]["y"] for p in dash["panels"]}) == len(dash["panels"])
