"""Shared fixtures: a real nats-server and redis-server for the whole session.

They are started on free ports unless HETMESH_TEST_NATS_URL / HETMESH_TEST_REDIS_URL name
servers to use; the ones a machine may run on the standard ports are never assumed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hetmesh import servers


@pytest.fixture(scope="session")
def infra() -> Iterator[tuple[str, str]]:
    with servers.infrastructure(os.environ.get("HETMESH_TEST_NATS_URL", ""),
                                os.environ.get("HETMESH_TEST_REDIS_URL", "")) as (nats_url, redis_url, _):
        yield nats_url, redis_url


@pytest.fixture(scope="session")
def nats_url(infra: tuple[str, str]) -> str:
    return infra[0]


@pytest.fixture(scope="session")
def redis_url(infra: tuple[str, str]) -> str:
    return infra[1]
