"""`python -m hetmesh.launcher [--cluster FILE]`: the whole mesh in one command; Ctrl-C stops it."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from hetmesh.launcher.mesh import Mesh


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hetmesh.launcher", description=__doc__)
    ap.add_argument("--cluster", default=None, help="cluster file (default ops/clusters/default.toml)")
    ap.add_argument("--port", type=int, default=None, help="gateway port (default: the cluster file's)")
    args = ap.parse_args(argv)
    from hetmesh import config

    mesh = Mesh(args.cluster or config.DEFAULT_CLUSTER, gateway_port=args.port)

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        mesh.start()
        workers = ", ".join(f"{g.count}x {g.accelerator} ({g.role})" for g in mesh.cfg.workers)
        print(f"hetmesh ready: {mesh.url}/v1  (nats {mesh.nats_url}, redis {mesh.redis_url})")
        print(f"  models: {', '.join(m.name for m in mesh.cfg.models)}; workers: {workers}")
        print("  metrics: " + ", ".join(f"{n} {u}" for n, u in mesh.metrics_urls().items()))
        print(f"  cluster view: hetmesh status --nats {mesh.nats_url}   bus: nats sub -s {mesh.nats_url} 'hetmesh.>'")
        print("  Ctrl-C stops everything this command started.", flush=True)
        while all(s.alive for s in mesh.services.values()):
            time.sleep(0.5)
        dead = [s.name for s in mesh.services.values() if not s.alive]
        print(f"service(s) exited: {dead}; stopping", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
