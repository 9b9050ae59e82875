"""`Mesh`: one cluster file -> nats-server, redis-server (when none is reachable) and every
service of the cluster as a separate process. The run command and the tests both use it; the run
command also supervises it (hetmesh.launcher.supervise): what dies is started again.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hetmesh import config, metrics, servers


class PortInUse(RuntimeError):
    """The gateway's port is taken by another process."""


@dataclass
class Service:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    metrics_port: int | None = None  # its /metrics, /health, /ready (the gateway's are on its API port)
    instance: str = ""  # the gateway's instance id this run (new at every start: its reply subjects)
    started: float = 0.0  # time.monotonic() of the last start

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Mesh:
    cluster_path: Path
    gateway_port: int | None = None  # None: the cluster file's; 0: a free port
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None  # None: children inherit this process's stdout/stderr
    # The children (and the servers it starts) die with this process however it dies, even by SIGKILL,
    # and stay out of its terminal's Ctrl-C (the launcher stops them in order). Spawn from the main thread.
    die_with_parent: bool = False
    nats_url: str = ""
    redis_url: str = ""
    services: dict[str, Service] = field(default_factory=dict)
    _infra: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _started: list[servers.ServerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cluster_path = Path(self.cluster_path)
        self.cfg = config.load(self.cluster_path)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.gateway.host}:{self.port}"

    def start(self, ready_timeout_s: float = 60.0) -> Mesh:
        self.port = self.gateway_port if self.gateway_port else self.cfg.gateway.port
        if self.gateway_port == 0:
            self.port = servers.free_port()
        elif not servers.port_free(self.cfg.gateway.host, self.port):  # before anything starts
            raise PortInUse(f"the gateway's port {self.cfg.gateway.host}:{self.port} is already in use")
        nats_url, redis_url, self._started = self._infra.enter_context(servers.infrastructure(
            self.nats_url or self.cfg.mesh.nats_url, self.redis_url or self.cfg.mesh.redis_url, self.die_with_parent))
        self.nats_url, self.redis_url = nats_url, redis_url
        cluster = ["--cluster", str(self.cluster_path)]
        py = [sys.executable, "-m"]
        self.add("scheduler", [*py, "hetmesh.scheduler", *cluster, "--instance", "sched-0"])
        for i in range(self.cfg.kv_transfer.replicas):
            self.add(f"kv-transfer-{i}", [*py, "hetmesh.kv_transfer", *cluster, "--instance", f"kvx-{i}"])
        for group in self.cfg.workers:
            for wid in group.worker_ids():
                self.add(f"worker:{wid}", [*py, "hetmesh.worker", *cluster, "--worker-id", wid])
        self.add("gateway", [*py, "hetmesh.gateway", *cluster, "--port", str(self.port)])
        if self.cfg.planner.mode != "off":  # it changes roles inside the running workers; it starts none
            self.add("planner", [*py, "hetmesh.planner_service", *cluster, "--instance", "planner-0"])
        for name in self.services:
            self.spawn(name)
        self.wait_ready(ready_timeout_s)
        return self

    def add(self, name: str, argv: list[str]) -> None:
        port = None if name == "gateway" else servers.free_port()
        self.services[name] = Service(name, argv, metrics_port=port)

    def metrics_urls(self) -> dict[str, str]:
        """Every service's Prometheus endpoint."""
        return {name: f"{self.url}/metrics" if s.metrics_port is None else f"http://127.0.0.1:{s.metrics_port}/metrics"
                for name, s in self.services.items()}

    def spawn(self, name: str) -> Service:
        svc = self.services[name]
        env = servers.env_with(HETMESH_NATS_URL=self.nats_url, HETMESH_REDIS_URL=self.redis_url, **self.env)
        if svc.metrics_port is not None:
            env[metrics.PORT_ENV] = str(svc.metrics_port)
            env.setdefault(metrics.HOST_ENV, "127.0.0.1")
        argv = svc.argv
        if name == "gateway":  # a new id per run: a restarted gateway must not get its last run's replies
            svc.instance = f"gw{secrets.token_hex(4)}"
            argv = [*argv, "--instance", svc.instance]
        hook = servers.parent_death_hook() if self.die_with_parent else None
        with contextlib.ExitStack() as files:  # the child keeps its own copy of the log file
            out = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                svc.log_path = self.log_dir / f"{name.replace(':', '_')}.log"
                out = files.enter_context(open(svc.log_path, "ab"))
            svc.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                        start_new_session=True, preexec_fn=hook)
        svc.started = time.monotonic()
        return svc

    def workers_expected(self) -> int:
        return sum(g.count for g in self.cfg.workers)

    def _get(self, path: str) -> dict[str, object] | None:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=1) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def ready(self) -> dict[str, object] | None:
        """The gateway's /ready answer, or None (no answer, or it is another process on the port)."""
        gw = self.services.get("gateway")
        if gw is not None and gw.instance and (self._get("/health") or {}).get("instance") != gw.instance:
            return None
        return self._get("/ready")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [s.name for s in self.services.values() if not s.alive]
            if dead:
                self.stop()
                raise RuntimeError(f"services exited during start-up: {dead}; logs in {self.log_dir}")
            status = self.ready()
            # /ready answers 200 once the gateway sees live workers; wait for all of them.
            if status is not None and int(str(status.get("workers", self.workers_expected()))) >= self.workers_expected():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"mesh not ready within {timeout_s}s; logs in {self.log_dir}")

    @property
    def started_servers(self) -> list[servers.ServerProcess]:
        """The nats-server / redis-server this mesh started itself (none when given reachable URLs)."""
        return list(self._started)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        svc = self.services[name]
        if svc.proc is not None and svc.proc.poll() is None:
            os.killpg(svc.proc.pid, sig)
            svc.proc.wait(10)

    def stop(self) -> None:
        procs = [s.proc for s in self.services.values() if s.proc is not None and s.proc.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._infra.close()

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def temp_log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="hetmesh-logs-"))
