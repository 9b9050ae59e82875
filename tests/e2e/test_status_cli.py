"""`hetmesh status` against the live e2e mesh: the scheduler's view as a table and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from hetmesh import servers
from hetmesh.launcher import Mesh

CLI = [sys.executable, "-m", "hetmesh.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


def test_status_table_lists_every_worker_with_role_load_and_kv(mesh: Mesh) -> None:
    r = run("status", "--nats", mesh.nats_url)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "policy prefix_aware" in r.stdout and "4 workers" in r.stdout
    for wid, role, accel in [("h100-0", "both", "nvidia-h100"), ("h100-1", "both", "nvidia-h100"),
                             ("cpx-0", "prefill", "nvidia-rubin-cpx"), ("vr200-0", "decode", "nvidia-rubin-vr200")]:
        row = next(ln for ln in lines if f" {wid} " in ln)
        assert role in row and accel in row and "sim" in row and "%" in row, row


def test_status_json_is_the_schedulers_reply(mesh: Mesh) -> None:
    r = run("status", "--nats", mesh.nats_url, "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["policy"] == "prefix_aware" and sorted(st["workers"]) == ["cpx-0", "h100-0", "h100-1", "vr200-0"]
    for w in st["details"]:
        assert w["kv_blocks_total"] > 0 and 0 <= w["kv_blocks_used"] <= w["kv_blocks_total"]
        assert w["running"] <= w["max_batch"] and w["heartbeat_age_s"] < 5
        # Decode-capable workers take KV on their own port (direct data plane); a prefill worker has none.
        assert bool(w["kv_endpoint"]) == (w["worker_id"] != "cpx-0"), w


def test_status_says_why_when_nothing_answers(mesh: Mesh) -> None:
    r = run("status", "--nats", f"nats://127.0.0.1:{servers.free_port()}", "--timeout", "1")
    assert r.returncode == 2 and "cannot reach NATS" in r.stderr
