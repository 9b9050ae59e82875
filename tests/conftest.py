"""Shared fixtures: a real nats-server and redis-server for the whole session; and the test lanes.

The servers are started on free ports unless HETMESH_TEST_NATS_URL / HETMESH_TEST_REDIS_URL name
servers to use; the ones a machine may run on the standard ports are never assumed.

Lanes (markers registered in pyproject.toml): every test gets exactly one of `failure` (under
tests/failures), `vllm` (under tests/vllm), `mesh` (it uses a fixture in PROCESS_FIXTURES, or says
`@pytest.mark.mesh` itself because its body starts a process) or `unit` (the rest: pure code). Long
unit tests say `@pytest.mark.slow`; `-m "unit and not slow"` is the fast lane (ops/test.sh --fast).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

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


LANES = ("unit", "mesh", "failure", "vllm")
# Fixtures that start nats-server, redis-server or mesh services (a test's fixture closure holding one of them
# is a mesh test). A new fixture that starts processes without using one of these joins the list.
PROCESS_FIXTURES = frozenset({
    "infra", "nats_url", "redis_url",  # above
    "gw_nats",  # gateway/conftest.py: a nats-server (and through it the peer, the gateway process)
    "mesh",  # e2e/ and failures/ conftest.py, services/test_worker_kv.py: a whole mesh
    "one_slot", "traced_mesh",  # e2e/test_priority.py, e2e/test_tracing.py
    "overload_mesh", "tenants_mesh",  # e2e/test_admission_tail.py, e2e/test_tenants.py
    "lonely",  # gateway/test_gateway_no_scheduler.py: a nats-server without a scheduler
    "secured",  # services/test_credentials.py: nats-server and redis-server with passwords
    "relay_mesh", "slow_mesh",  # services/test_worker_kv.py, services/test_worker_working.py
})
TESTS = Path(__file__).parent


def lane(item: pytest.Item) -> str:
    """The lane of a test that names none itself."""
    folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
    if folder == "failures":
        return "failure"
    if folder == "vllm":
        return "vllm"
    if PROCESS_FIXTURES.intersection(item.fixturenames):
        return "mesh"
    return "unit"


def pytest_configure(config: pytest.Config) -> None:
    # matplotlib builds its font cache on first use by running fc-list: done here, once, so that a unit test that
    # plots on a fresh machine does not start that process itself (_unit_starts_no_process)
    import matplotlib.font_manager  # noqa: F401

    # SIGTERM ends the run as Ctrl-C does, fixtures torn down (their meshes stopped): how ops/test.sh stops the
    # lane it runs in the background, and what a CI runner's timeout sends
    def term(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, term)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(name) for name in LANES):
            item.add_marker(lane(item))


@pytest.fixture(autouse=True)
def _unit_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test that starts a process fails here, saying how to move it to the mesh lane."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(self: subprocess.Popen[bytes], args: object, *a: object, **kw: object) -> None:
        raise AssertionError(f"a unit test started a process ({args!r}): mark it @pytest.mark.mesh, or add the "
                             "fixture that starts it to PROCESS_FIXTURES in tests/conftest.py")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
