"""ops/k8s (kustomize base + overlays), checked offline.

Every manifest validates against the Kubernetes API schemas (the kubernetes-validate package ships
them, strict: unknown fields fail). Each overlay's resources (base + its own, which is what
kustomize renders apart from name prefixes and patches) are checked against the code: modules,
arguments, environment, probe ports, worker ids of the overlay's cluster file, node pools per
vendor, autoscaler bounds. Where `kubectl` is installed, `kubectl kustomize` renders each overlay
and the rendered output is validated too.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hetmesh import config, metrics
from hetmesh.protocol import Role

from .conftest import ROLE_MODULE, ROOT, env_read_by_code

K8S = ROOT / "ops" / "k8s"
BASE = K8S / "base"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.30.0"
# accelerator vendor -> (device plugin resource / taint key) for the accelerator's node pool
VENDOR_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu", "tenstorrent": "tenstorrent.com/n300"}


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(d: Path) -> dict[str, Any]:
    return yaml.safe_load((d / "kustomization.yaml").read_text())


def resources_of(d: Path) -> list[dict[str, Any]]:
    """The resources a kustomization pulls in, recursively (bases first)."""
    out: list[dict[str, Any]] = []
    for r in kustomization(d)["resources"]:
        p = (d / r).resolve()
        out += resources_of(p) if p.is_dir() else docs(p)
    return out


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    for doc in docs(path):
        validate(doc)


def test_an_invalid_manifest_is_caught() -> None:
    dep = next(d for d in docs(BASE / "gateway.yaml") if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)
    dep = next(d for d in docs(BASE / "gateway.yaml") if d["kind"] == "Deployment")
    dep["spec"]["replica"] = 2  # a typo: strict schemas reject unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)


def test_kustomizations_reference_files_that_exist() -> None:
    for d in [BASE, *OVERLAYS]:
        k = kustomization(d)
        assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
        assert k["namespace"] == "hetmesh"
        for r in k["resources"]:
            assert (d / r).exists(), f"{d}: {r}"
        for g in k.get("configMapGenerator", []):
            for f in g["files"]:
                assert (d / f).is_file(), f"{d}: {f}"
        for p in k.get("patches", []):
            ops = json.loads((d / p["path"]).read_text())
            assert all(o["op"] in {"add", "replace", "remove"} and o["path"].startswith("/spec/") for o in ops)
            names = {(r["kind"], r["metadata"]["name"]) for r in resources_of(d)}
            assert (p["target"]["kind"], p["target"]["name"]) in names


def test_nats_is_a_three_node_jetstream_cluster() -> None:
    res = docs(BASE / "nats.yaml")
    sts = next(r for r in res if r["kind"] == "StatefulSet")
    conf = next(r for r in res if r["kind"] == "ConfigMap")["data"]["nats.conf"]
    assert sts["spec"]["replicas"] == 3 and "jetstream" in conf
    routes = [f"nats://nats-{i}.{sts['spec']['serviceName']}:6222" for i in range(3)]
    assert all(r in conf for r in routes)
    headless = next(r for r in res if r["kind"] == "Service" and r["metadata"]["name"] == sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    env = next(r for r in docs(BASE / "env.yaml"))["data"]
    # the clients list every node (a StatefulSet pod through the headless Service)
    nodes = [f"nats://nats-{i}.{sts['spec']['serviceName']}:4222" for i in range(3)]
    assert env["HETMESH_NATS_URL"].split(",") == nodes


def containers(r: dict[str, Any]) -> list[dict[str, Any]]:
    return r["spec"]["template"]["spec"]["containers"]


def arg(c: dict[str, Any], flag: str) -> str:
    return c["args"][c["args"].index(flag) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_runs_what_the_code_reads(overlay: Path) -> None:
    res = resources_of(overlay)
    env = next(r for r in res if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "hetmesh-env")["data"]
    assert set(env) <= env_read_by_code(), sorted(set(env) - env_read_by_code())
    cfg_path = env["HETMESH_CLUSTER"]
    gen = next(g for g in kustomization(overlay)["configMapGenerator"] if g["name"] == "hetmesh-cluster")
    cfg = config.load(overlay / gen["files"][0])  # the file mounted at HETMESH_CLUSTER
    metrics_port = int(env[metrics.PORT_ENV])
    if cfg.kv_transfer.data_plane == "direct":  # decode workers' KV port, dialled at the pod's address
        assert env["HETMESH_KV_LISTEN_HOST"] == "0.0.0.0"
    services = {r["metadata"]["name"]: r for r in res if r["kind"] == "Service"}
    workloads = [r for r in res if r["kind"] in ("Deployment", "StatefulSet")]
    sets = {}
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        c = pod["containers"][0]
        if not c.get("command", [""] * 3)[2].startswith("hetmesh."):
            continue  # nats, redis, jaeger
        module = c["command"][2]
        assert c["command"][:2] == ["python", "-m"] and importlib.util.find_spec(module), module
        assert {"configMapRef": {"name": "hetmesh-env"}} in c["envFrom"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "cluster")
        assert f"{mount['mountPath']}/cluster.toml" == cfg_path
        vol = next(v for v in pod["volumes"] if v["name"] == "cluster")
        assert vol["configMap"]["name"] == "hetmesh-cluster"
        # The readiness probe asks the port the process listens on.
        port = int(arg(c, "--port")) if module == "hetmesh.gateway" else metrics_port
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}, w["metadata"]["name"]
        assert {"containerPort": port}.items() <= next(p for p in c["ports"]).items()
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port)
        if "worker" not in module:
            assert w["kind"] == "Deployment"
            continue
        # Workers: a StatefulSet per worker group; pod name <group>-<ordinal> is the worker id.
        assert w["kind"] == "StatefulSet" and arg(c, "--worker-id") == "$(POD_NAME)"
        # SIGTERM drains: the pod's grace period covers the drain and the hand-over after it.
        assert pod["terminationGracePeriodSeconds"] == cfg.worker.grace_period_s, w["metadata"]["name"]
        # Every worker gets the one KV secret (senders tag with it, KV ports check it), from a Secret.
        kv_secret = next(e for e in c["env"] if e["name"] == "HETMESH_KV_SECRET")
        assert kv_secret["valueFrom"]["secretKeyRef"]["name"] == "hetmesh-kv"
        assert "HETMESH_KV_SECRET" in env_read_by_code()
        assert w["spec"]["serviceName"] in services
        group = next(g for g in cfg.workers if g.name == w["metadata"]["name"])
        assert module == ROLE_MODULE[group.role]
        assert 1 <= w["spec"]["replicas"] <= group.count
        assert w["spec"]["template"]["metadata"]["labels"]["hetmesh.io/role"] == Role(group.role).value
        sets[group.name] = w
        if group.engine != "sim":  # real accelerators: the pool's nodes and the vendor's device plugin
            resource = VENDOR_RESOURCE[group.vendor]
            assert pod["nodeSelector"] == {"hetmesh.io/accelerator": group.accelerator}
            assert {"key": resource, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert str(c["resources"]["limits"][resource]) == str(group.devices)
            assert any(m["mountPath"] == "/models" for m in c["volumeMounts"])
    assert set(sets) == {g.name for g in cfg.workers}, "every worker group of the cluster file runs"
    hpas = [r for r in res if r["kind"] == "HorizontalPodAutoscaler"]
    assert hpas
    for h in hpas:
        target = h["spec"]["scaleTargetRef"]
        assert target["kind"] == "StatefulSet" and target["name"] in sets
        group = next(g for g in cfg.workers if g.name == target["name"])
        assert h["spec"]["maxReplicas"] == group.count  # ids past count are not in the cluster file
        assert h["spec"]["metrics"][0]["pods"]["metric"]["name"] == "hetmesh_worker_queue_depth"
    if overlay.name == "production":
        assert {g.vendor for g in cfg.workers} == set(VENDOR_RESOURCE)


@pytest.mark.mesh  # runs kubectl
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: kustomize rendering skipped "
                    "(the resources are still validated one by one above)")
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_kubectl_kustomize_renders_valid_manifests(overlay: Path) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    rendered = [d for d in yaml.safe_load_all(out) if d]
    for d in rendered:
        validate(d)
        assert d["kind"] == "Namespace" or d["metadata"]["namespace"] == "hetmesh"
    cm = next(d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("hetmesh-cluster"))
    for d in rendered:
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] not in ("nats", "redis", "jaeger"):
            vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
            assert vols["cluster"]["configMap"]["name"] == cm["metadata"]["name"]  # the generated, hashed name
    if overlay.name == "production":
        gw = next(d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway")
        assert any(m["mountPath"] == "/models" for m in gw["spec"]["template"]["spec"]["containers"][0]["volumeMounts"])
