"""The scheduler's report of what it was asked for (hetmesh.planner.live.DemandWindow), for the planner: one
`DemandReport` on `hetmesh.sched.demand` every planner interval."""

from __future__ import annotations

import asyncio
import logging
import time

from hetmesh import subjects
from hetmesh.bus import Bus
from hetmesh.planner.live import DemandWindow
from hetmesh.protocol import DemandReport

log = logging.getLogger("hetmesh.scheduler")


async def publish_demand(bus: Bus, instance: str, demand: DemandWindow, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await bus.publish(subjects.DEMAND, DemandReport(instance=instance, window_s=demand.window_s, ts=time.time(),
                                                            models=demand.report(time.monotonic())))
        except Exception:
            log.exception("publishing demand failed")
