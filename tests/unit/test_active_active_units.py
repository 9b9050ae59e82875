"""The pure parts of running on a NATS cluster with several gateways and schedulers: the node list and the
replicas check, which gateway a reply subject names, and when a worker counts a gateway as gone."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.clusters import cluster_toml, group, load_cluster, model

from hetmesh import config, subjects
from hetmesh.worker.gateways import GatewayWatch

URLS = "nats://a:4222, nats://b:4222,nats://c:4222"


def cluster(**mesh: object) -> str:
    return cluster_toml(mesh=mesh, work_queue={"replicas": 3}, models=[model("m")],
                        workers=[group("g", "m", "nvidia-h100")])


def test_nats_url_lists_every_node() -> None:
    assert config.nats_servers(URLS) == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    assert config.nats_servers("nats://a:4222") == ["nats://a:4222"]


def test_more_replicas_than_nodes_listed_is_refused(tmp_path: Path) -> None:
    assert load_cluster(tmp_path, cluster(nats_url=URLS)).work_queue.replicas == 3
    with pytest.raises(ValueError, match=r"replicas = 3 but mesh\.nats_url lists 1 NATS node"):
        load_cluster(tmp_path, cluster(nats_url="nats://a:4222"))
    # no URL in the file: the deployment's environment gives it (the k8s overlays)
    assert load_cluster(tmp_path, cluster()).work_queue.replicas == 3


def test_reply_subject_names_its_gateway() -> None:
    assert subjects.reply_gateway(subjects.reply_to("gw1", "req-0")) == "gw1"
    assert subjects.reply_gateway("hetmesh.resp.req") == ""
    assert subjects.reply_gateway("inbox.x") == ""


def test_a_gateway_heard_then_silent_is_gone() -> None:
    w = GatewayWatch(timeout_s=1.0)
    w.heard(subjects.gateway_alive("gw1"), 0.0)
    w.heard(subjects.gateway_alive("gw2"), 0.0)
    held = [("r1", subjects.reply_to("gw1", "r1-0")), ("r2", subjects.reply_to("gw2", "r2-0")),
            ("r3", subjects.reply_to("never-heard", "r3-0"))]
    assert w.gone(0.9) == set()
    w.heard(subjects.gateway_alive("gw2"), 1.0)
    assert w.gone(1.5) == {"gw1"}  # gw2 beats on; a gateway never heard is left alone
    assert w.orphans(held, {"gw1"}) == ["r1"]


def test_the_workers_own_bus_gap_is_not_a_gateways_death() -> None:
    w = GatewayWatch(timeout_s=1.0)
    w.heard(subjects.gateway_alive("gw1"), 0.0)
    w.bus_gap(5.0)  # it heard nothing meanwhile: its own outage
    assert w.gone(5.5) == set()
    assert w.gone(6.5) == {"gw1"}  # a timeout after the gap, still silent: gone
