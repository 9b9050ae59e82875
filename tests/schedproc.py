"""A scheduler process on the test's nats-server and redis-server (tests/services)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hetmesh.servers import env_with


@contextmanager
def scheduler_process(cluster: str, workdir: Path, nats_url: str, redis_url: str, instance: str = "",
                      **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m hetmesh.scheduler` on the cluster file text `cluster` (`instance`: its --instance, `env`: more
    environment); its log is printed at the end."""
    (workdir / "c.toml").write_text(cluster)
    args = ["--instance", instance] if instance else []
    with open(workdir / "scheduler.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "hetmesh.scheduler", "--cluster", str(workdir / "c.toml"), *args],
                             env=env_with(HETMESH_NATS_URL=nats_url, HETMESH_REDIS_URL=redis_url, **env), stdout=log,
                             stderr=subprocess.STDOUT)
        try:
            yield p
        finally:
            p.terminate()
            p.wait(10)
    print((workdir / "scheduler.log").read_text()[-3000:])
