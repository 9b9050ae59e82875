"""`hetmesh up [--cluster FILE] [--port N]`: the whole mesh in one command, kept up until Ctrl-C.

Every process that exits is started again with backoff (a worker drained by SIGTERM too); one that
crash-loops is given up and reported, the rest keeps running. The mesh stops on SIGINT, SIGTERM or
SIGHUP to this command, or when the gateway, the scheduler or the nats-server crash-loops. The
processes it starts die with it, even when it is killed. While it runs, `hetmesh status` finds it
through its run file (see `hetmesh status --help`).

Exit status: 0 after a stop asked for with nothing given up; 1 when a process was given up or the mesh
failed to start; 2 when the gateway's port is already in use (nothing is started then).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from hetmesh.launcher import runfile
from hetmesh.launcher.mesh import Mesh, PortInUse
from hetmesh.launcher.supervise import Backoff, Supervisor


class _Stop:
    """SIGINT/SIGTERM/SIGHUP, handled explicitly (a launcher started in the background with SIGINT ignored
    stops on it all the same). The first one interrupts a start-up under way; later ones are noted only,
    so the stop itself runs to its end."""

    def __init__(self) -> None:
        self.asked = False
        self.starting = True
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self)

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.asked:
            return
        self.asked = True
        if self.starting:
            raise KeyboardInterrupt


def main(argv: list[str] | None = None, prog: str = "hetmesh up") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default=None, help="cluster file (default ops/clusters/default.toml)")
    ap.add_argument("--port", type=int, default=None, help="gateway port (default: the cluster file's; 0: a free one)")
    ap.add_argument("--max-restarts", type=int, default=5, metavar="N",
                    help="a process that exits more than N times within --restart-window is given up (default 5)")
    ap.add_argument("--restart-window", type=float, default=60.0, metavar="S", help="seconds (default 60)")
    args = ap.parse_args(argv)
    from hetmesh import config

    stop = _Stop()
    mesh: Mesh | None = None
    sup: Supervisor | None = None
    try:
        mesh = Mesh(args.cluster or config.DEFAULT_CLUSTER, gateway_port=args.port, die_with_parent=True)
        mesh.start()
        sup = Supervisor(mesh, lambda: Backoff(max_restarts=args.max_restarts, window_s=args.restart_window))
        stop.starting = False
        state = {"nats_url": mesh.nats_url, "redis_url": mesh.redis_url, "gateway_url": mesh.url,
                 "cluster": str(mesh.cluster_path.resolve()), "started_at": time.time()}
        path = runfile.write({**state, "services": sup.services_state()})
        workers = ", ".join(f"{g.count}x {g.accelerator} ({g.role})" for g in mesh.cfg.workers)
        print(f"hetmesh ready: {mesh.url}/v1  (nats {mesh.nats_url}, redis {mesh.redis_url})")
        print(f"  models: {', '.join(m.name for m in mesh.cfg.models)}; workers: {workers}")
        if sim := sorted({g.model for g in mesh.cfg.workers if g.engine == "sim"}):  # what a newcomer meets first
            print(f"  {', '.join(sim)}: simulated (engine sim): real timing, random text; for real text serve a "
                  'model with engine = "vllm" (docs/deployment.md#real-vllm-workers)')
        print("  metrics: " + ", ".join(f"{n} {u}" for n, u in mesh.metrics_urls().items()))
        print(f"  cluster view: hetmesh status   bus: nats sub -s {mesh.nats_url} 'hetmesh.>'   run file: {path}")
        print("  Ctrl-C stops everything this command started; a process that exits is started again.", flush=True)
        sup.run(lambda: stop.asked, lambda: runfile.write({**state, "services": sup.services_state()}))
    except PortInUse as exc:
        print(f"{prog}: {exc} (another mesh or server?); choose another with --port", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:  # start-up failed: one line says why
        print(f"{prog}: the mesh did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        stop.asked = True  # a signal during the stop below is noted only
        if mesh is not None:
            mesh.stop()
        runfile.remove()
    if sup is not None and sup.failed:
        print(f"{prog}: stopped: {sup.failed}", file=sys.stderr)
        return 1
    if sup is not None and sup.given_up:
        print(f"{prog}: stopped; given up while it ran: {', '.join(sup.given_up)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m hetmesh.launcher"))
