"""SLO-aware admission's hold without flow control: a refused request placed again after each `hold_s` the
policy allows (`hetmesh.placement.admission.hold_wait_s`), its wait counted in its TTFT. With flow control
(`flowgate.py`) held requests wait in the fair queue instead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from hetmesh.placement import REFUSED, Decision, RequestInfo
from hetmesh.placement.admission import hold_wait_s


async def hold(info: RequestInfo, decision: Decision, place: Callable[[RequestInfo], Decision | None],
               scale: float, limit_s: float, on_hold: Callable[[], None]) -> Decision | None:
    """Place `info` again (`place`) while refused and the policy allows a hold, for at most `limit_s` (wall
    seconds: the gateway's hold_limit_s); `scale`: the engines' clock per wall second (the policy's clock);
    `on_hold` counts each wait."""
    t0, a0, w0 = time.monotonic(), info.arrival, info.waited_s
    limit = limit_s * scale
    d: Decision | None = decision
    while d is not None and d.mode == REFUSED and (
            wait := hold_wait_s(d, (time.monotonic() - t0) * scale, limit)) is not None:
        on_hold()
        await asyncio.sleep(wait / scale)
        held = time.monotonic() - t0
        d = place(msgspec.structs.replace(info, arrival=a0 + held * scale, waited_s=w0 + held * scale))
    return d
