"""The planner's leader lease on a real nats-server's JetStream KV: one holder at a time, renewals that
race do not lose it, a dead holder's lease ages out, and a holder that was overtaken knows it."""

from __future__ import annotations

import asyncio
import uuid

import nats

from hetmesh.planner_service.service import LEASE_KEY, Lease


async def test_one_holder_renewals_race_and_a_dead_holder_ages_out(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().create_key_value(bucket=f"lease_{uuid.uuid4().hex[:8]}", ttl=1.0, history=1)
        a, b = Lease(kv, "a"), Lease(kv, "b")
        assert await a.refresh() and not await b.refresh()
        assert all(await asyncio.gather(*(a.refresh() for _ in range(5))))  # concurrent renewals keep it
        assert not await b.refresh()
        a.revision = None  # a renewal's answer lost: its own key is still there, and it carries on
        assert await a.refresh() and (await kv.get(LEASE_KEY)).value == b"a"
        # a stops renewing (it died): once the key ages out, b takes it, and a's next renewal fails
        async with asyncio.timeout(10):
            while True:
                if await b.refresh():
                    break
                await asyncio.sleep(0.2)
        assert not await a.refresh() and a.revision is None
        assert await b.refresh()
    finally:
        await nc.close()
