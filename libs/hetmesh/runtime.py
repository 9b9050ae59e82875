"""How every service process starts and stops: logging, uvloop, start, run until SIGTERM/SIGINT, stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("hetmesh.runtime")


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def setup_process() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


async def serve(make: Callable[[], Service]) -> None:
    """Build the service inside the loop, start it, and stop it cleanly on SIGTERM or SIGINT."""
    svc = make()
    await svc.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s stopping", type(svc).__name__)
    await svc.stop()


def run_service(make: Callable[[], Service]) -> None:
    setup_process()
    asyncio.run(serve(make))
