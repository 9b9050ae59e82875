"""`hetmesh up` as an operator runs it: a real launcher process supervising a real mesh. A worker killed -9
or drained is started again while the other streams go on; a dead redis-server or nats-server is reaped
and started again on its port; a crash loop is given up without stopping the rest; `hetmesh status`
finds the mesh through the run file; children die with the launcher; a taken port fails clearly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hetmesh import servers
from hetmesh.engines.sampling import expected_completion
from hetmesh.launcher import runfile
from hetmesh.protocol import SamplingParams
from hetmesh.tokenizer import ByteTokenizer

pytestmark = pytest.mark.mesh

TOK = ByteTokenizer()
CLUSTER = """
[mesh]
time_scale = 0.5   # a decode token takes about 20 ms: a 150-token stream lasts a few seconds
heartbeat_interval_s = 0.2
heartbeat_timeout_s = 1.0

[worker]
drain_timeout_s = 2.0

[[models]]
name = "m"
spec = "llama-3.1-8b"
max_context = 4096
block_size = 16

[[workers]]
name = "h100"
model = "m"
accelerator = "nvidia-h100"
role = "both"
count = {workers}
"""


class Launcher:
    """`python -m hetmesh.launcher` in its own run folder; its run file read on demand."""

    def __init__(self, d: Path, workers: int, *args: str) -> None:
        (d / "cluster.toml").write_text(CLUSTER.format(workers=workers))
        self.run_dir = d / "run"
        self.env = {k: v for k, v in os.environ.items() if k not in ("HETMESH_NATS_URL", "HETMESH_REDIS_URL")}
        self.env["HETMESH_RUN_DIR"] = str(self.run_dir)
        self.out, self.err = d / "launcher.out", d / "launcher.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "hetmesh.launcher", "--cluster", str(d / "cluster.toml"),
                                          "--port", "0", *args], env=self.env, stdout=out, stderr=err)

    def state(self) -> dict[str, Any]:
        return json.loads((self.run_dir / f"mesh-{self.proc.pid}.json").read_text())

    def wait(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"the launcher exited: {self.err.read_text()[-3000:]}"
            with contextlib.suppress(OSError, ValueError):
                if pred(st := self.state()):
                    return st
            assert time.monotonic() < deadline, f"{what}: {self.err.read_text()[-3000:]}"
            time.sleep(0.1)

    def pid(self, name: str) -> int:
        return int(self.state()["services"][name]["pid"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        print(f"--- launcher stderr\n{self.err.read_text()[-4000:]}")


def restarted(name: str, n: int = 1) -> Callable[[dict[str, Any]], bool]:
    return lambda st: st["services"][name]["restarts"] >= n and st["services"][name]["state"] == "running"


def gone(pid: int) -> bool:
    """Not running: exited and reaped, or a zombie left to whoever adopted it."""
    return not runfile.alive(pid)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    la = Launcher(tmp_path_factory.mktemp("up"), 2, "--max-restarts", "2", "--restart-window", "300")
    try:
        la.wait("the mesh never got ready", lambda st: True, timeout_s=120)
        yield la
    finally:
        la.stop()


def expected_text(prompt: str, n: int) -> str:
    return expected_completion(TOK, TOK.encode(prompt), SamplingParams(max_tokens=n, ignore_eos=True))[1]


async def stream(url: str, prompt: str, n: int, on_chunk: Callable[[int], None] = lambda _: None) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True}
    text, chunks = "", 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])
                    assert "error" not in c, c
                    text += c["choices"][0]["text"] if c.get("choices") else ""
                    chunks += 1
                    on_chunk(chunks)
    return text


def complete(url: str, prompt: str, n: int = 4) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": "m", "prompt": prompt, "max_tokens": n, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_status_finds_the_launched_mesh_without_flags(up: Launcher) -> None:
    stale = up.run_dir / "mesh-999999999.json"  # a launcher that was killed: its pid is gone
    stale.write_text(json.dumps({"pid": 999999999, "nats_url": "nats://127.0.0.1:1", "started_at": time.time() + 60}))
    r = subprocess.run([sys.executable, "-m", "hetmesh.cli", "status"], env=up.env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert " h100-0 " in r.stdout and " h100-1 " in r.stdout
    assert f"hetmesh up (pid {up.proc.pid}" in r.stdout and "restarts:" in r.stdout
    assert not stale.exists()
    r = subprocess.run([sys.executable, "-m", "hetmesh.cli", "sim", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.startswith("usage: hetmesh sim ")
    r = subprocess.run([sys.executable, "-m", "hetmesh.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert all(f"hetmesh {cmd} " in r.stdout for cmd in ("up", "status", "plan", "sim"))


async def test_a_worker_killed_9_is_started_again_and_the_streams_go_on(up: Launcher) -> None:
    url = up.state()["gateway_url"]
    victim = up.pid("worker:h100-0")
    killed = False

    def kill_once(chunks: int) -> None:
        nonlocal killed
        if chunks == 10 and not killed:
            killed = True
            os.kill(victim, signal.SIGKILL)

    prompts = [f"a stream across a worker's death {i} " for i in range(6)]
    texts = await asyncio.gather(*(stream(url, p, 150, kill_once if i == 0 else lambda _: None)
                                   for i, p in enumerate(prompts)))
    assert killed
    assert texts == [expected_text(p, 150) for p in prompts]  # every stream whole, the moved ones too
    st = await asyncio.to_thread(up.wait, "the worker was not started again", restarted("worker:h100-0"))
    assert st["services"]["worker:h100-0"]["pid"] != victim and gone(victim)
    assert all(s["state"] == "running" for s in st["services"].values())


def test_a_drained_worker_that_exits_0_is_started_again(up: Launcher) -> None:
    victim = up.pid("worker:h100-1")
    os.kill(victim, signal.SIGTERM)  # a drain: it finishes its work and exits 0
    st = up.wait("the drained worker was not started again", restarted("worker:h100-1"))
    assert st["services"]["worker:h100-1"]["pid"] != victim
    assert "worker:h100-1 exited 0" in up.err.read_text()
    assert complete(st["gateway_url"], "after the drain ") == expected_text("after the drain ", 4)


def test_a_killed_redis_and_nats_server_are_reaped_and_started_on_their_ports(up: Launcher) -> None:
    before = up.state()
    for name in ("redis-server", "nats-server"):
        old = up.pid(name)
        os.kill(old, signal.SIGKILL)
        up.wait(f"{name} was not started again", restarted(name))
        assert gone(old)  # reaped by the launcher: not left a zombie
    st = up.state()
    assert (st["redis_url"], st["nats_url"]) == (before["redis_url"], before["nats_url"])
    assert servers.reachable(st["redis_url"]) and servers.reachable(st["nats_url"])
    deadline = time.monotonic() + 60
    while True:  # the services reconnect on their own backoff
        with contextlib.suppress(AssertionError, httpx.HTTPError):
            assert complete(st["gateway_url"], "after the servers came back ") == \
                expected_text("after the servers came back ", 4)
            break
        assert time.monotonic() < deadline, up.err.read_text()[-3000:]
        time.sleep(0.2)


def test_a_crash_loop_is_given_up_and_the_rest_keeps_serving(up: Launcher) -> None:
    name = "kv-transfer-0"
    for n in range(1, 4):  # --max-restarts 2: the third exit is a crash loop
        st = up.wait(f"{name} not running", lambda st, n=n: st["services"][name]["state"] == "running"
                     and st["services"][name]["restarts"] == n - 1)
        os.kill(int(st["services"][name]["pid"]), signal.SIGKILL)
    st = up.wait(f"{name} was not given up", lambda st: st["services"][name]["state"] == "given up")
    assert "crash loop" in up.err.read_text()
    assert up.proc.poll() is None
    assert complete(st["gateway_url"], "with kv-transfer given up ") == expected_text("with kv-transfer given up ", 4)


def test_the_launcher_stops_on_sigterm_with_a_failure_status(up: Launcher) -> None:
    pids = [int(p["pid"]) for p in up.state()["services"].values() if p["state"] == "running"]
    path = runfile.path_for(up.proc.pid)
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 1  # a process was given up while it ran
    assert "given up while it ran: kv-transfer-0" in up.err.read_text()
    assert all(gone(p) for p in pids)
    assert not (up.run_dir / path.name).exists()


def test_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    la = Launcher(tmp_path, 1)
    try:
        pids = [int(p["pid"]) for p in la.wait("not ready", lambda st: True, timeout_s=120)["services"].values()]
        la.proc.kill()
        la.proc.wait()
        deadline = time.monotonic() + 60  # a worker drains first (SIGTERM): a couple of seconds
        while not all(gone(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if not gone(p)]
            time.sleep(0.2)
    finally:
        la.stop()


def test_a_taken_gateway_port_fails_at_once_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        (tmp_path / "cluster.toml").write_text(CLUSTER.format(workers=1))
        r = subprocess.run([sys.executable, "-m", "hetmesh.launcher", "--cluster", str(tmp_path / "cluster.toml"),
                            "--port", str(port)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "HETMESH_RUN_DIR": str(tmp_path / "run")})
    assert r.returncode == 2 and "ready" not in r.stdout
    assert r.stderr.count("\n") == 1 and f"127.0.0.1:{port} is already in use" in r.stderr
