"""Shared by the deployment-file tests: where things are and what the code reads."""

from __future__ import annotations

import re
from pathlib import Path

from opentelemetry.sdk import environment_variables as otel_env

from hetmesh.protocol import Role

ROOT = Path(__file__).resolve().parents[2]
ROLE_MODULE = {Role.BOTH: "hetmesh.worker", Role.PREFILL: "hetmesh.prefill_worker",
               Role.DECODE: "hetmesh.decode_worker"}


def env_read_by_code() -> set[str]:
    """Every HETMESH_* name that appears as a string in the code, plus the OpenTelemetry SDK's variables."""
    names = {m for p in [*(ROOT / "libs").rglob("*.py"), *(ROOT / "services").rglob("*.py")]
             for m in re.findall(r"[\"'](HETMESH_[A-Z0-9_]+)[\"']", p.read_text())}
    return names | {n for n in dir(otel_env) if n.startswith("OTEL_")}
