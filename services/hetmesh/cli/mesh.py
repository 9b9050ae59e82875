"""Finding the mesh a command talks to, and asking its scheduler for its view."""

from __future__ import annotations

import asyncio
import os

import msgspec
import nats

from hetmesh import config, subjects
from hetmesh.launcher import runfile
from hetmesh.protocol import SchedulerStatus

DEFAULT_NATS = "nats://127.0.0.1:4222"


def nats_url(arg: str | None, cluster: str | None) -> str:
    """--nats, $HETMESH_NATS_URL, --cluster's mesh.nats_url, the running launcher's, $HETMESH_CLUSTER's, localhost."""
    if arg:
        return arg
    if v := os.environ.get("HETMESH_NATS_URL"):
        return v
    if cluster and (url := config.load(cluster).mesh.nats_url):
        return url
    if (launched := runfile.find()) is not None:
        return str(launched["nats_url"])
    if os.environ.get("HETMESH_CLUSTER") and (url := config.load(None).mesh.nats_url):
        return url
    return DEFAULT_NATS


async def fetch_status(url: str, timeout_s: float) -> SchedulerStatus:
    async def quiet(_exc: Exception) -> None:  # the caller says what went wrong, once
        pass

    async with asyncio.timeout(timeout_s * 2):
        nc = await nats.connect(config.nats_servers(url), connect_timeout=timeout_s, allow_reconnect=False,
                                max_reconnect_attempts=0, error_cb=quiet)
    try:
        reply = await nc.request(subjects.SCHED_STATUS, b"", timeout=timeout_s)
        return msgspec.json.decode(reply.data, type=SchedulerStatus)
    finally:
        await nc.close()
