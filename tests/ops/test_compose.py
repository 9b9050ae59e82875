"""docker-compose.yml and docker-compose.vllm.yml, checked without a Docker engine.

1. Both files are valid against the Compose specification's JSON schema (the copy that ships in
   the check-jsonschema package, so no network is needed).
2. What each Hetmesh container runs agrees with the code: module, arguments, environment
   variables the code reads, the ports it listens on (published ports, health checks,
   Prometheus targets), worker ids of the cluster file it names, the files the image holds.
3. The default compose services' own command lines and environments, run here as processes
   against a real nats-server and redis-server, give a working API and live /ready endpoints.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import yaml

from hetmesh import config, metrics, servers

from .conftest import ROLE_MODULE, ROOT, env_read_by_code

COMPOSE = ROOT / "docker-compose.yml"
VLLM = ROOT / "docker-compose.vllm.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
APP = "/app"  # the image's WORKDIR, where docker/Dockerfile puts ops/clusters

# Read by something other than Hetmesh: the NVIDIA container runtime and ROCm's HIP runtime.
RUNTIME_ENV = {"NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"}


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # resolves the files' anchors and `<<` merges like Compose


def hetmesh_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in doc["services"].items() if str([*s.get("command", []), "", "", ""][2]).startswith("hetmesh.")}


@pytest.mark.parametrize("path", [COMPOSE, VLLM], ids=lambda p: p.name)
def test_compose_file_is_valid_against_the_compose_spec(path: Path) -> None:
    schema = json.loads((importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
                         / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(load(path)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_a_schema_violation_is_caught() -> None:
    schema = json.loads((importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
                         / "compose-spec.json").read_text())
    bad = load(COMPOSE)
    bad["services"]["gateway"]["comand"] = bad["services"]["gateway"].pop("command")  # a typo
    assert list(jsonschema.validators.validator_for(schema)(schema).iter_errors(bad))


def test_infrastructure_services() -> None:
    s = load(COMPOSE)["services"]
    nodes = [f"nats-{i}" for i in range(3)]  # a 3-node JetStream cluster, routes to every node
    for n in nodes:
        cmd = s[n]["command"]
        assert "--jetstream" in cmd and cmd[cmd.index("--name") + 1] == n and "--cluster_name" in cmd
        assert cmd[cmd.index("--routes") + 1].split(",") == [f"nats://{m}:6222" for m in nodes]
        assert "/data" in s[n]["volumes"][0] and len({s[m]["volumes"][0] for m in nodes}) == 3
    assert "8222:8222" in s["nats-0"]["ports"]
    assert "4222:4222" in s["nats-0"]["ports"] and "6379:6379" in s["redis"]["ports"]
    assert {"16686:16686", "4318:4318"} <= set(s["jaeger"]["ports"])
    assert "8000:8000" in s["gateway"]["ports"]
    for name, svc in s.items():
        if "build" in svc:
            continue  # built from docker/ here
        image = svc["image"]
        assert re.search(r":v?\d+\.\d+\.\d+", image), f"{name}: image {image} is not pinned to a release"


@pytest.mark.parametrize("path", [COMPOSE, VLLM], ids=lambda p: p.name)
def test_every_container_runs_what_the_code_reads(path: Path) -> None:
    doc = load(COMPOSE)
    if path == VLLM:  # an override: its services on top of the base file's, environments merged
        over = load(VLLM)["services"]
        for name, svc in over.items():
            base = doc["services"].setdefault(name, {})
            env = {**base.get("environment", {}), **svc.get("environment", {})}
            base.update(svc, environment=env)
    readable = env_read_by_code() | RUNTIME_ENV
    svcs = hetmesh_services(doc)
    assert svcs
    by_cluster: dict[str, set[str]] = {}
    for name, svc in svcs.items():
        if path == VLLM and "sim" in svc.get("profiles", []):
            continue
        cmd = svc["command"]
        assert cmd[:2] == ["python", "-m"], name
        module = cmd[2]
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        env = svc["environment"]
        unknown = set(env) - readable
        assert not unknown, f"{name}: the code reads no {sorted(unknown)}"
        assert env["HETMESH_NATS_URL"].split(",") == [f"nats://nats-{i}:4222" for i in range(3)]
        assert env["HETMESH_WORK_QUEUE_REPLICAS"] == "3" and env["HETMESH_REDIS_URL"] == "redis://redis:6379/0"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"  # Jaeger's OTLP/HTTP port
        cluster_path = ROOT / Path(env["HETMESH_CLUSTER"]).relative_to(APP)
        cfg = config.load(cluster_path)
        # The port it listens on is the one its health check asks.
        probe = " ".join(svc["healthcheck"]["test"])
        if module == "hetmesh.gateway":
            port = int(cmd[cmd.index("--port") + 1])
            assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
            assert f"{port}:{port}" in doc["services"]["gateway"]["ports"]
        else:
            port = int(env[metrics.PORT_ENV])
        assert f"127.0.0.1:{port}/ready" in probe, name
        if "worker" in module:
            wid = cmd[cmd.index("--worker-id") + 1]
            group = cfg.group_of(wid)  # KeyError: a worker id the cluster file does not have
            assert module == ROLE_MODULE[group.role], f"{name}: {module} for a {group.role} worker"
            if group.role != "prefill" and cfg.kv_transfer.data_plane == "direct":
                # Its KV port must take connections from the prefill workers' containers.
                assert env.get("HETMESH_KV_LISTEN_HOST") == "0.0.0.0", f"{name}: KV port on loopback only"
            by_cluster.setdefault(str(cluster_path), set()).add(wid)
            # SIGTERM drains: compose must wait for the drain and the hand-over before it SIGKILLs.
            assert svc["stop_grace_period"] == f"{cfg.worker.grace_period_s}s", name
    for cluster_path, wids in by_cluster.items():
        expected = {w for g in config.load(cluster_path).workers for w in g.worker_ids()}
        assert wids == expected, f"{cluster_path}: compose runs {sorted(wids)}, the cluster has {sorted(expected)}"


def test_vllm_workers_reserve_their_accelerators() -> None:
    s = load(VLLM)["services"]
    cuda, rocm = s["worker-vllm-cuda-0"], s["worker-vllm-rocm-0"]
    dev = cuda["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert cuda["build"]["dockerfile"] == "docker/vllm-cuda.Dockerfile"
    assert {"/dev/kfd", "/dev/dri"} <= set(rocm["devices"]) and "video" in rocm["group_add"]
    assert rocm["build"]["dockerfile"] == "docker/vllm-rocm.Dockerfile"
    assert cuda["profiles"] == ["cuda"] and rocm["profiles"] == ["rocm"]
    for name in ("worker-h100-0", "prefill-worker-cpx-0", "decode-worker-vr200-0"):
        assert s[name]["profiles"] == ["sim"]  # the simulated cluster's workers stay off


def test_dockerfile_is_multi_stage_pinned_slim_and_not_root() -> None:
    text = DOCKERFILE.read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)", text, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base.group(1))
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("root", "0"))
    assert f"COPY ops/clusters {APP}/ops/clusters" in text and f"WORKDIR {APP}" in text
    assert "requirements.lock" in text
    lock = (ROOT / "docker" / "requirements.lock").read_text().split("\n")
    pins = [ln for ln in lock if ln and not ln.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[\w.\-+]+", ln) for ln in pins)
    # Every runtime dependency of pyproject.toml is in the lock.
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    locked = {re.split("==", ln)[0].lower().replace("_", "-") for ln in pins}
    for d in deps:
        name = re.split(r"[<>=\[ ]", d)[0].lower().replace("_", "-")
        assert name in locked, f"{name} is not in docker/requirements.lock"


def test_prometheus_scrapes_every_hetmesh_container() -> None:
    targets = {t for job in yaml.safe_load((ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())
               ["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    s = load(COMPOSE)["services"]
    expected = set()
    for name, svc in hetmesh_services(load(COMPOSE)).items():
        cmd = svc["command"]
        port = cmd[cmd.index("--port") + 1] if "--port" in cmd else svc["environment"][metrics.PORT_ENV]
        expected.add(f"{name}:{port}")
    assert targets == expected
    assert "./ops/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in s["prometheus"]["volumes"]


# --- the compose command lines, run as processes -----------------------------------------------------
@contextlib.contextmanager
def compose_as_processes(tmp: Path) -> Iterator[tuple[str, dict[str, int]]]:
    """Start every Hetmesh service of docker-compose.yml with its own command and environment; only
    host names become this machine's servers and each container's ports become free ports here."""
    with contextlib.ExitStack() as stack:
        nats_cluster = servers.start_nats_cluster(3)  # compose's NATS is a 3-node cluster, the queue on each node
        stack.callback(nats_cluster.stop)
        nats_url, redis_url, _ = stack.enter_context(servers.infrastructure(nats_cluster.url))
        procs: list[subprocess.Popen[bytes]] = []
        ports: dict[str, int] = {}
        try:
            for name, svc in hetmesh_services(load(COMPOSE)).items():
                env = dict(svc["environment"])
                env.pop("OTEL_EXPORTER_OTLP_ENDPOINT")  # no Jaeger here
                env["HETMESH_NATS_URL"], env["HETMESH_REDIS_URL"] = nats_url, redis_url
                env["HETMESH_CLUSTER"] = str(ROOT / Path(env["HETMESH_CLUSTER"]).relative_to(APP))
                argv = [sys.executable, *svc["command"][1:]]
                port = servers.free_port()
                ports[name] = port
                if "--port" in argv:
                    argv[argv.index("--port") + 1] = str(port)
                    argv[argv.index("--host") + 1] = "127.0.0.1"
                else:
                    env[metrics.PORT_ENV] = str(port)
                    env[metrics.HOST_ENV] = "127.0.0.1"
                log = open(tmp / f"{name}.log", "wb")  # closed when the process exits
                procs.append(subprocess.Popen(argv, env=servers.env_with(**env), stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            yield nats_url, ports
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.mark.mesh  # nats-server, redis-server and the services as processes
def test_the_compose_services_serve_the_api(tmp_path: Path) -> None:
    cfg = config.load(ROOT / "ops" / "clusters" / "default.toml")
    workers = sum(g.count for g in cfg.workers)
    with compose_as_processes(tmp_path) as (_nats, ports):
        api = f"http://127.0.0.1:{ports['gateway']}"
        deadline = time.monotonic() + 90
        ready: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = httpx.get(f"{api}/ready", timeout=2).json()
                if ready.get("status") == "ready" and ready.get("workers") == workers:
                    break
            time.sleep(0.3)
        logs = {p.name: p.read_text(errors="replace")[-800:] for p in tmp_path.glob("*.log")}
        assert ready.get("workers") == workers, (ready, logs)
        client = openai.OpenAI(base_url=f"{api}/v1", api_key="unused", max_retries=0, timeout=30)
        r = client.chat.completions.create(model=cfg.models[0].name, max_tokens=8,
                                           messages=[{"role": "user", "content": "compose"}])
        assert r.usage.completion_tokens == 8
        for name, port in ports.items():
            if name == "gateway":
                continue
            probe = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
            assert probe.status_code == 200 and probe.json()["ready"] is True, (name, probe.text)
            assert "hetmesh_" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def test_grafana_is_provisioned_with_the_dashboard_and_its_datasource() -> None:
    grafana = load(COMPOSE)["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    prov = ROOT / "ops" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["url"] == "http://prometheus:9090" and "9090:9090" in load(COMPOSE)["services"]["prometheus"]["ports"]
    provider = yaml.safe_load((prov / "dashboards" / "hetmesh.yml").read_text())["providers"][0]
    assert mounts["./ops/grafana/dashboards"] == provider["options"]["path"]
    dash = json.loads((ROOT / "ops" / "grafana" / "dashboards" / "hetmesh.json").read_text())
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    assert uids == {ds["uid"]}
