"""Redis clients on a bounded, blocking connection pool, and telling a full pool from a dead Redis.

redis-py's default pool raises `MaxConnectionsError` as soon as every connection is busy, so a burst of
concurrent calls fails exactly like a Redis outage would. A `BlockingConnectionPool` makes a call wait
(up to `wait_s`) for a free connection instead: a burst queues for a few milliseconds. When even that
wait runs out, the caller sees `pool_exhausted(exc)` and can degrade for that one call without
treating Redis as down.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError

MAX_CONNECTIONS = 64  # per process: Lua calls take well under a millisecond, so a burst queues briefly
WAIT_S = 2.0  # how long a call waits for a free connection before giving up (pool_exhausted)
_NO_CONNECTION = "No connection available."  # BlockingConnectionPool's message when its wait runs out


def blocking_client(url: str, max_connections: int = MAX_CONNECTIONS, wait_s: float = WAIT_S,
                    **options: Any) -> aioredis.Redis:
    """A client whose calls wait for a free connection (at most `max_connections`, at most `wait_s`).
    `options`: redis.asyncio.from_url() keyword arguments (timeouts, credentials, TLS, decode_responses)."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s,
                                                    **options)
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes both


def pool_exhausted(exc: BaseException) -> bool:
    """The call failed for want of a free connection in this process's pool, not because Redis is away."""
    if isinstance(exc, MaxConnectionsError):
        return True
    return (isinstance(exc, RedisConnectionError) and str(exc) == _NO_CONNECTION
            and isinstance(exc.__cause__, TimeoutError))
