"""A restarted service is back sooner the less it imports: no service loads scipy at start (only the planner's
solve and the cost model's fit use it, and import it when they run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.mesh  # each import in a fresh interpreter

HEAVY = ("scipy",)


@pytest.mark.parametrize("service", ["worker", "scheduler", "gateway", "kv_transfer", "planner_service"])
def test_a_service_starts_without_scipy(service: str) -> None:
    code = (f"import sys, hetmesh.{service}.__main__\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"hetmesh.{service} imports {r.stdout.strip()} at start"
