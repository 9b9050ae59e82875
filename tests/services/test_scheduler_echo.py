"""A scheduler hears none of its own publications back: every message delivered costs it a wake-up, and its own
bookings were as many messages as all the others' together. Counted by nats-server itself (/connz, per
subscription), on a server of this test's own with monitoring on."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

from tests.schedproc import scheduler_process
from tests.services.test_scheduler import CLUSTER, Beater, request, submit

from hetmesh import servers, subjects
from hetmesh.bus import Bus
from hetmesh.protocol import Booked


def booked_delivered(monitor_port: int) -> int:
    """Messages nats-server delivered to the scheduler's hetmesh.sched.booked subscription."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz?subs=detail", timeout=2) as r:
        conns = json.load(r)["connections"]
    return sum(s["msgs"] for c in conns if c.get("name", "").startswith("scheduler-")
               for s in c.get("subscriptions_list_detail", []) if s["subject"] == subjects.SCHED_BOOKED)


async def test_a_scheduler_does_not_hear_its_own_bookings(redis_url: str, tmp_path: Path) -> None:
    monitor = servers.free_port()
    srv = servers.start_nats(monitor_port=monitor)
    try:
        with scheduler_process(CLUSTER, tmp_path, srv.url, redis_url):
            bus = await Bus.connect(srv.url, "test")
            beater = Beater(bus, ["a-0", "a-1"])
            await asyncio.sleep(0.3)
            for i in range(3):
                assert (await submit(bus, request(f"echo-{i}", [1, 2, 3, i]))).placement is not None
            await asyncio.sleep(0.3)  # its bookings are out (and would be back)
            assert booked_delivered(monitor) == 0
            # Another scheduler's booking is delivered (and counted here): the count above is not blind.
            await bus.publish(subjects.SCHED_BOOKED, [Booked(scheduler="sched-other", request_id="o",
                                                             decode_worker="a-0")])
            await asyncio.sleep(0.3)
            assert booked_delivered(monitor) == 1
            beater.task.cancel()
            await bus.close()
    finally:
        srv.stop()
