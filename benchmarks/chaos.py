"""Chaos soak through `hetmesh up`: the launcher supervises a whole mesh (nats-server, redis-server,
gateway, scheduler, kv-transfer, sim workers aggregated and disaggregated) while closed-loop clients send
mixed streaming and non-streaming requests, and every `--every` seconds one process picked at random
among {worker, scheduler, gateway, kv-transfer, nats-server, redis-server} (its pid from the launcher's
run file) is killed with SIGKILL.

Every completed text is checked against the sim engine's own text for the request. A request whose
gateway was killed while it ran (or that was sent while the gateway was down) is counted apart and sent
again until it completes, as a client would; every other failure is an error. Per kill it measures how
long until the process was started again (a new pid in the run file) and until it was back (its own
/ready: a service's on its metrics port, the gateway's on its API port with a new instance, a server
reachable on its port), and until the whole mesh was ready again (every service's /ready and the gateway
seeing every worker). At the end the launcher must still run and stop cleanly on SIGTERM: exit 0, no
child left, no traceback after the signal. Prints a table and writes results/chaos_launcher.json with the
machine (platform, cpus, load average).

    .venv/bin/python benchmarks/chaos.py --duration 300 --every 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import CLUSTER, PREFIXES, expected, pct  # sibling script: the same mesh and texts

from hetmesh import servers
from hetmesh.launcher import runfile

KINDS = ("worker", "scheduler", "gateway", "kv-transfer", "nats-server", "redis-server")


class Launcher:
    """`python -m hetmesh.launcher` in its own run folder; the children log into its stdout/stderr."""

    def __init__(self, d: Path, cluster: Path) -> None:
        self.run_dir = d / "run"
        env = {k: v for k, v in os.environ.items() if k not in ("HETMESH_NATS_URL", "HETMESH_REDIS_URL")}
        env["HETMESH_RUN_DIR"] = str(self.run_dir)
        self.out, self.err = d / "launcher.out", d / "launcher.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "hetmesh.launcher", "--cluster", str(cluster),
                                          "--port", "0"], env=env, stdout=out, stderr=err)
        self.ready_urls: dict[str, str] = {}

    def state(self) -> dict[str, Any]:
        return json.loads((self.run_dir / f"mesh-{self.proc.pid}.json").read_text())

    def wait_up(self, timeout_s: float = 180) -> dict[str, Any]:
        """Until it printed its metrics URLs (it is ready then); each service's /ready is beside its /metrics."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited: {self.err.read_text()[-3000:]}")
            m = re.search(r"^  metrics: (.*)$", self.out.read_text(errors="replace"), re.M)
            if m:
                self.ready_urls = {n: u.removesuffix("/metrics") + "/ready"
                                   for n, u in re.findall(r"(\S+) (http://\S+/metrics)", m.group(1))}
                return self.state()
            time.sleep(0.2)
        raise TimeoutError(f"the launcher was not ready in {timeout_s} s: {self.err.read_text()[-3000:]}")


def ok(url: str, timeout_s: float = 1.0) -> dict[str, Any] | None:
    try:
        r = httpx.get(url, timeout=timeout_s)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def is_ready(la: Launcher, st: dict[str, Any], name: str, old_instance: str = "") -> bool:
    """`name` answers as ready: a server on its port, a service on its /ready (the gateway: a new run of it)."""
    if name == "nats-server":
        return servers.reachable(st["nats_url"])
    if name == "redis-server":
        return servers.reachable(st["redis_url"])
    if name == "gateway":
        health = ok(st["gateway_url"] + "/health")
        return health is not None and health.get("instance") != old_instance and \
            ok(st["gateway_url"] + "/ready") is not None
    return ok(la.ready_urls[name]) is not None


def mesh_ready(la: Launcher, st: dict[str, Any], workers: int) -> bool:
    gw = ok(st["gateway_url"] + "/ready")
    return gw is not None and int(gw.get("workers", 0)) >= workers and \
        all(s["state"] == "running" for s in st["services"].values()) and \
        all(is_ready(la, st, n) for n in st["services"] if n != "gateway")


class Load:
    """Closed-loop clients; the gateway's down windows decide which failures are the gateway's death."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.cut: Counter[str] = Counter()  # failed tries of requests whose gateway was killed, by what was seen
        self.outcomes_resent = 0  # requests sent again because their gateway was killed
        self.latency_s: list[float] = []
        self.wrong: list[dict[str, Any]] = []
        self.gateway_down: list[list[float | None]] = []  # [killed at, back at] (monotonic)

    def gateway_killed_during(self, t0: float, t1: float) -> bool:
        return any(k <= t1 and (b is None or b >= t0) for k, b in self.gateway_down)

    async def attempt(self, http: httpx.AsyncClient, body: dict[str, Any], cancel: bool) -> tuple[str, str]:
        """('text', text) | ('error', what) | ('cancelled', '')."""
        if not body["stream"]:
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 200:
                return "error", f"{r.status_code} {r.text[:120]}"
            return "text", r.json()["choices"][0]["text"]
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return "error", f"{resp.status_code} {resp.text[:120]}"
            parts: list[str] = []
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "text", "".join(parts)
                payload = json.loads(line[6:])
                if "error" in payload:
                    return "error", f"stream {payload['error'].get('code')}: {payload['error'].get('message', '')[:80]}"
                parts.extend(c["text"] for c in payload["choices"])
                if cancel and len(parts) >= 3:
                    return "cancelled", ""  # leaving the block closes the connection mid-stream
            return "error", "stream ended without [DONE]"

    async def one(self, http: httpx.AsyncClient, rng: random.Random, stop: float) -> None:
        stream = rng.random() < 0.5
        prompt = rng.choice(PREFIXES) + f"request {rng.randrange(10**6)}"
        body = {"model": rng.choice(["agg", "agg", "pd"]), "prompt": prompt, "max_tokens": rng.randint(8, 128),
                "stream": stream, "ignore_eos": rng.random() < 0.5}
        want = expected(prompt, body["max_tokens"], body["ignore_eos"])
        cancel = stream and rng.random() < 0.15
        t_first = time.monotonic()
        resent = False
        while True:
            t0 = time.monotonic()
            try:
                what, got = await self.attempt(http, body, cancel)
            except httpx.TimeoutException:
                what, got = "hung", ""
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                what, got = "error", f"client {type(exc).__name__}"
            t1 = time.monotonic()
            if what == "text":
                if got == want:
                    self.outcomes["ok"] += 1
                    self.latency_s.append(t1 - t_first)
                else:
                    self.outcomes["wrong_text"] += 1
                    self.wrong.append({"body": body, "got": got, "want": want})
                return
            if what == "cancelled":
                self.outcomes["cancelled"] += 1
                return
            if self.gateway_killed_during(t0, t1):  # its gateway died: the client sends it again
                self.cut[got[:60] if what == "error" else what] += 1
                if not resent:
                    resent = True
                    self.outcomes_resent += 1
                if time.monotonic() >= stop + 60:
                    self.outcomes["gateway_killed_gave_up"] += 1
                    return
                await asyncio.sleep(0.2)
                continue
            self.outcomes[what] += 1
            self.errors[got or what] += 1
            return

    async def clients(self, n: int, seed: int, stop: float) -> None:
        rng = random.Random(seed)

        async def client(r: random.Random) -> None:
            async with httpx.AsyncClient(base_url=self.url, timeout=90) as http:
                while time.monotonic() < stop:
                    await self.one(http, r, stop)

        await asyncio.gather(*(client(random.Random(rng.random())) for _ in range(n)))


async def chaos(la: Launcher, load: Load, duration_s: float, every_s: float, seed: int,
                workers: int) -> list[dict[str, Any]]:
    rng = random.Random(seed + 1)
    t_start = time.monotonic()
    kills: list[dict[str, Any]] = []
    k = 0
    while True:
        await asyncio.sleep(max(0.0, t_start + every_s * (k + 1) - time.monotonic()))
        if time.monotonic() >= t_start + duration_s - 1.0:
            return kills
        k += 1
        st = la.state()
        kind = rng.choice(KINDS)
        name = rng.choice(sorted(n for n in st["services"] if n.split(":")[0].rstrip("-0123456789") == kind))
        old = int(st["services"][name]["pid"])
        old_instance = (ok(st["gateway_url"] + "/health") or {}).get("instance", "") if name == "gateway" else ""
        t_kill = time.monotonic()
        if name == "gateway":
            load.gateway_down.append([t_kill, None])
        os.kill(old, signal.SIGKILL)
        row: dict[str, Any] = {"at_s": round(t_kill - t_start, 1), "service": name, "old_pid": old,
                               "new_pid": None, "restarted_s": None, "back_s": None, "mesh_ready_s": None}
        while time.monotonic() - t_kill < 60:
            with contextlib.suppress(OSError, ValueError):
                st = la.state()
            now = time.monotonic() - t_kill
            svc = st["services"][name]
            if row["restarted_s"] is None and svc["pid"] not in (None, old) and svc["state"] == "running":
                row["new_pid"], row["restarted_s"] = svc["pid"], round(now, 2)
            if row["restarted_s"] is not None and row["back_s"] is None and \
                    await asyncio.to_thread(is_ready, la, st, name, old_instance):
                row["back_s"] = round(time.monotonic() - t_kill, 2)
                if name == "gateway":
                    load.gateway_down[-1][1] = time.monotonic()
            if row["back_s"] is not None and await asyncio.to_thread(mesh_ready, la, st, workers):
                row["mesh_ready_s"] = round(time.monotonic() - t_kill, 2)
                break
            await asyncio.sleep(0.05)
        if name == "gateway" and load.gateway_down[-1][1] is None:
            load.gateway_down[-1][1] = time.monotonic()
        row["restarts"] = st["services"][name]["restarts"]
        kills.append(row)


def stop_launcher(la: Launcher) -> dict[str, Any]:
    """SIGTERM, then: its exit status, how long it took, children left running, tracebacks after the signal."""
    pids = [int(p["pid"]) for p in la.state()["services"].values() if p["pid"]]
    err_at = la.err.stat().st_size
    t0 = time.monotonic()
    la.proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = la.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
        la.proc.kill()
        la.proc.wait()
    took = time.monotonic() - t0
    time.sleep(1.0)
    with open(la.err, "rb") as f:
        f.seek(err_at)
        tail = f.read().decode(errors="replace")
    return {"exit_code": code, "stop_s": round(took, 1), "children_left": [p for p in pids if runfile.alive(p)],
            "tracebacks_after_sigterm": tail.count("Traceback"),
            "warnings_after_sigterm": len(re.findall(r"WARNING|ERROR", tail)),
            "run_file_removed": not (la.run_dir / f"mesh-{la.proc.pid}.json").exists()}


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load and kills")
    ap.add_argument("--every", type=float, default=20.0, help="seconds between kills")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    ap.add_argument("--time-scale", type=float, default=5.0, help="sim engines run this much faster than real time")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="results/chaos_launcher.json")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="hetmesh-chaos-"))
    (d / "cluster.toml").write_text(CLUSTER.format(time_scale=args.time_scale, drain_timeout_s=2.0))
    machine_start = machine()
    la = Launcher(d, d / "cluster.toml")
    try:
        st = la.wait_up()
        workers = sum(1 for n in st["services"] if n.startswith("worker:"))
        load = Load(st["gateway_url"])

        async def run() -> list[dict[str, Any]]:
            stop = time.monotonic() + args.duration
            kills, _ = await asyncio.gather(chaos(la, load, args.duration, args.every, args.seed, workers),
                                            load.clients(args.clients, args.seed, stop))
            return kills

        t0 = time.monotonic()
        kills = asyncio.run(run())
        wall = time.monotonic() - t0
        launcher_up = la.proc.poll() is None
        final = la.state() if launcher_up else {}
        stopped = stop_launcher(la) if launcher_up else {"exit_code": la.proc.returncode}
    finally:
        if la.proc.poll() is None:
            la.proc.send_signal(signal.SIGTERM)
            la.proc.wait(60)
    outcomes = load.outcomes
    res = {
        "duration_s": args.duration, "every_s": args.every, "wall_s": round(wall, 1), "clients": args.clients,
        "time_scale": args.time_scale, "seed": args.seed, "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes), "errors": dict(load.errors),
        "resent_after_gateway_kill": load.outcomes_resent, "gateway_killed_tries": dict(load.cut), "wrong_texts": load.wrong[:5],
        "latency_p50_s": pct(load.latency_s, 0.5), "latency_p99_s": pct(load.latency_s, 0.99),
        "kills": kills, "kills_by_kind": dict(Counter(k["service"].split(":")[0].rstrip("-0123456789") for k in kills)),
        "back_s_max": max((k["back_s"] for k in kills if k["back_s"] is not None), default=None),
        "not_back_within_5s": [k["service"] for k in kills if k["back_s"] is None or k["back_s"] > 5.0],
        "mesh_ready_s_max": max((k["mesh_ready_s"] for k in kills if k["mesh_ready_s"] is not None), default=None),
        "launcher_up_at_end": launcher_up,
        "restarts_at_end": {n: s["restarts"] for n, s in final.get("services", {}).items()},
        "stop": stopped, "logs": str(d),
        "machine": {**machine_start, "load_avg_end": machine()["load_avg"]},
        "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    con = Console(width=160)  # the whole rows in a log file too
    t = Table(title="kill -9 through hetmesh up")
    for col in ("#", "at s", "killed", "pid", "restarted s", "back s", "mesh ready s"):
        t.add_column(col, no_wrap=True)
    for i, k in enumerate(kills, 1):
        slow = k["back_s"] is None or k["back_s"] > 5.0
        t.add_row(str(i), f"{k['at_s']:.1f}", k["service"], f"{k['old_pid']} -> {k['new_pid']}", str(k["restarted_s"]),
                  f"[red]{k['back_s']}[/red]" if slow else str(k["back_s"]), str(k["mesh_ready_s"]))
    con.print(t)
    s = Table("figure", "value", title=f"{res['requests']} requests in {wall:.0f} s, {args.clients} clients")
    for key in ("outcomes", "errors", "resent_after_gateway_kill", "gateway_killed_tries", "latency_p50_s", "latency_p99_s", "kills_by_kind",
                "back_s_max", "not_back_within_5s", "mesh_ready_s_max", "launcher_up_at_end", "stop", "machine"):
        s.add_row(key, json.dumps(res[key]))
    con.print(s)
    con.print(f"wrote {args.out}; logs in {d}")


if __name__ == "__main__":
    main()
