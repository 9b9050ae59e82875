"""The scheduler's flow gate (services' hetmesh.scheduler.flowgate) without a bus: a request's booked cost leaves
its tenant's share whichever way it leaves the mesh, and a finished one's SLO verdict is counted per tenant."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.clusters import cluster_toml, group, load_cluster, model

from hetmesh import wiring
from hetmesh.placement import ClusterState, Decision, RequestInfo
from hetmesh.protocol import InferenceRequest, SamplingParams
from hetmesh.scheduler.flowgate import FlowGate

CLUSTER = cluster_toml(scheduler={"policy": "cost"}, tenants=[{"name": "a"}, {"name": "b"}],
                       models=[model("m", spec="llama-3.1-8b")], workers=[group("w", "m", "nvidia-h100")])


def _gate(tmp_path: Path) -> FlowGate:
    cfg = load_cluster(tmp_path, CLUSTER)
    q = wiring.flow(cfg)
    assert q is not None
    return FlowGate(cfg, q, lambda info: Decision(mode="aggregated", decode_worker="w-0"), ClusterState(2.0))


def _req(rid: str, tenant: str) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=list(range(100)), block_hashes=[], arrival_ts=0.0,
                            sampling=SamplingParams(max_tokens=20), reply_subject="r", tenant=tenant)


async def test_booked_cost_leaves_its_share_once_and_the_slo_verdict_is_counted(tmp_path: Path) -> None:
    g = _gate(tmp_path)
    for rid in ("1", "2", "3"):
        out = await g.place(_req(rid, "a"), RequestInfo(request_id=rid, model="m", prompt_len=100, max_tokens=20), 0)
        assert not isinstance(out, tuple) or out[0] is not None
    st = g.q.tenants["a"]
    assert st.inflight == pytest.approx(3 * g.inflight["1"][1])
    g.done("1", True)  # finished within its SLOs
    g.done("2", False)  # finished late
    g.done("3")  # never dispatched, or reconciling found no worker holds it: released, not judged
    g.done("3")  # a second report of the same request releases nothing more
    assert st.inflight == pytest.approx(0.0) and not g.inflight
    assert (st.stats.finished, st.stats.slo_met) == (2, 1)
    rows = {(name, labels["tenant"]): v for name, _, _, labels, v in g.rows()}
    assert rows[("hetmesh_tenant_slo_attained_total", "a")] == 1
    assert rows[("hetmesh_tenant_finished_total", "a")] == 2
    assert g.status()["a"]["slo_attainment"] == 0.5 and g.status()["b"]["finished"] == 0
