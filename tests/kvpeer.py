"""A stranger on a KV port (hetmesh.kvstream): what it answers to bytes nobody should send."""

from __future__ import annotations

import asyncio


async def answer_to(host: str, port: int, junk: bytes, timeout_s: float) -> bytes:
    """Write `junk`, hang up our side, and read the port's whole answer: b"" when it just closed."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(junk)
        await writer.drain()
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), timeout_s)
    except OSError:  # it hung up first, our junk unread: reset, broken pipe, or not connected at our EOF
        return b""
    finally:
        writer.close()
