"""hetmesh: run, watch and plan a heterogeneous LLM-serving mesh.

  hetmesh up       start the whole mesh of a cluster file and keep it up (Ctrl-C stops it)
  hetmesh status   the live cluster view (workers, roles, load, KV use) as the scheduler sees it
  hetmesh plan     lay out a fleet or choose chips to buy for a demand; --live: the planner's proposal
  hetmesh sim      replay a trace on a cluster file in the simulator, policy against policy
  hetmesh calibrate  fit the cost model's efficiency factors, from a live mesh or one engine

`hetmesh <command> --help` says more about each.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec
import nats
import nats.errors
import nats.js.errors
from rich.console import Console
from rich.table import Table

from hetmesh import config, subjects
from hetmesh.cli import calibrate, plan
from hetmesh.cli.mesh import DEFAULT_NATS, fetch_status, nats_url
from hetmesh.launcher import runfile
from hetmesh.protocol import PlanProposal, SchedulerStatus, WorkerStatus

STATUS_HELP = f"""The live cluster view (workers, roles, load, KV use) as a table. It asks the scheduler on
`hetmesh.sched.status` (the same request as `nats req hetmesh.sched.status ''`), so it shows what
placement decisions are made from; below it, the launcher's processes and their restarts.

Which mesh: --nats, else $HETMESH_NATS_URL, else --cluster's mesh.nats_url, else the mesh that
`hetmesh up` (or ops/run.sh) runs on this machine, found through its run file
(<run folder>/mesh-<pid>.json; the run folder is $HETMESH_RUN_DIR, else $XDG_RUNTIME_DIR/hetmesh,
else <tmp>/hetmesh-<uid>; now {runfile.run_dir()}), else $HETMESH_CLUSTER's, else {DEFAULT_NATS}."""


def processes_line(state: dict[str, object]) -> str:
    """The launcher's processes: how many run, what restarted, what was given up."""
    procs: dict[str, dict[str, object]] = state.get("services", {})  # type: ignore[assignment]
    running = sum(1 for p in procs.values() if p.get("state") == "running")
    restarted = ", ".join(f"{n} x{p['restarts']}" for n, p in procs.items() if int(str(p.get("restarts", 0))))
    other = ", ".join(f"{n} ({p['state']})" for n, p in procs.items() if p.get("state") != "running")
    return (f"hetmesh up (pid {state.get('pid')}, gateway {state.get('gateway_url')}): {running}/{len(procs)} "
            f"processes running; restarts: {restarted or 'none'}" + (f"; {other}" if other else ""))


def speed(w: WorkerStatus) -> str:
    """Its learned speed against the catalog prior (x1.00 = as priced), +-the fit's spread; "degraded" when much
    slower than its peers; "prior" until its engine has reported steps."""
    if not w.fitted_steps:
        return "prior"
    out = f"x{w.speed:.2f} ±{100 * w.speed_rel_std:.0f}%"
    return out + (f" degraded ({w.vs_peers:.1f}x peers)" if w.degraded else "")


def tenant_table(status: SchedulerStatus) -> Table:
    """Flow control's figures per tenant (none: flow control is off, no [[tenants]])."""
    t = Table(title="tenants" if status.tenants else "tenants: flow control off (no [[tenants]] in the cluster file)")
    cols = ("weight", "band", "requests", "placed", "refused", "held", "held_s", "tokens", "in_flight_cost_s",
            "finished", "slo_attainment")
    t.add_column("tenant")
    for c in cols:
        t.add_column(c, justify="right")
    for name, row in sorted(status.tenants.items()):
        t.add_row(name, *(f"{row.get(c, 0):g}" for c in cols))
    return t


def table(status: SchedulerStatus) -> Table:
    t = Table(title=f"scheduler {status.instance} · policy {status.policy} · {len(status.details)} workers · "
                    f"{status.in_flight} requests in flight")
    for col, justify in [("worker", "left"), ("model", "left"), ("accelerator", "left"), ("role", "left"),
                         ("engine", "left"), ("queue", "right"), ("running", "right"), ("KV blocks", "right"),
                         ("KV use", "right"), ("KV port", "left"), ("tokens", "right"), ("speed", "right"),
                         ("heartbeat", "right")]:
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for w in status.details:
        kv = f"{w.kv_blocks_used}/{w.kv_blocks_total}" if w.kv_blocks_total else "-"
        use = f"{100 * w.kv_blocks_used / w.kv_blocks_total:.1f}%" if w.kv_blocks_total else "-"
        accel = w.accelerator if w.devices == 1 else f"{w.devices}x {w.accelerator} ({w.parallel})"
        # moving: `both -> prefill` (a RoleSwitch), and `agg -> pd` in the model column too (a ModelSwitch)
        role = f"{w.role.value} -> {w.moving_to}" if w.moving_to else w.role.value + (" (draining)" if w.draining else "")
        role += " (wedged)" if w.wedged else ""
        model = f"{w.model} -> {w.moving_model}" if w.moving_model else w.model
        t.add_row(w.worker_id, model, accel, role, w.engine, str(w.queue_depth),
                  f"{w.running}/{w.max_batch}", kv, use, w.kv_endpoint or "-", str(w.tokens_generated), speed(w),
                  f"{w.heartbeat_age_s:.1f}s ago")
    return t


async def fetch_proposal(url: str, timeout_s: float) -> PlanProposal | None:
    """The leading planner's last proposal (JetStream KV bucket hetmesh_planner_plan), None if none yet."""
    async with asyncio.timeout(timeout_s * 2):
        nc = await nats.connect(config.nats_servers(url), connect_timeout=timeout_s, allow_reconnect=False,
                                max_reconnect_attempts=0)
    try:
        kv = await nc.jetstream(timeout=timeout_s).key_value(subjects.PLAN_BUCKET)
        entry = await kv.get("latest")
        return msgspec.json.decode(entry.value or b"", type=PlanProposal)
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
        return None
    finally:
        await nc.close()


def proposal_table(p: PlanProposal) -> Table:
    t = Table(title=f"planner {p.planner} · {p.mode} · chose {p.chosen or '-'} · simulated goodput "
                    f"{p.current_goodput_tok_s:.1f} -> {p.predicted_goodput_tok_s:.1f} tok/s")
    for col in ("worker", "current", "proposed", "move", "out of service", "sent"):
        t.add_column(col)
    moves = {m.worker_id: m for m in p.moves}
    for w in sorted(p.current.keys() | p.proposed.keys()):
        m = moves.get(w)
        t.add_row(w, p.current.get(w, "-"), p.proposed.get(w, "(not planned)"), m.change if m else "-",
                  f"{m.seconds:.1f}s" if m else "-", "yes" if w in p.sent else "")
    return t


def live(args: argparse.Namespace) -> int:
    url = nats_url(args.nats, None)
    try:
        p = asyncio.run(fetch_proposal(url, 2.0))
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        print(f"hetmesh plan --live: cannot read the planner's proposal at {url}: {exc or type(exc).__name__}",
              file=sys.stderr)
        return 2
    if p is None:
        print("hetmesh plan --live: no proposal yet (is a planner running with planner.mode advise or act?)",
              file=sys.stderr)
        return 2
    Console(width=160).print(proposal_table(p))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetmesh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    up_help = "start the whole mesh of a cluster file and keep it up: what exits is started again (--help: more)"
    sub.add_parser("up", help=up_help, add_help=False)
    st = sub.add_parser("status", help="print the live cluster view as the scheduler sees it",
                        description=STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--nats", help="NATS URL of the mesh (default: see above)")
    st.add_argument("--cluster", help="cluster file to read mesh.nats_url from")
    st.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for NATS and the scheduler")
    st.add_argument("--json", action="store_true", help="print the scheduler's reply as JSON")
    st.add_argument("--tenants", action="store_true", help="print flow control's per-tenant figures too")
    plan.add_parser(sub)
    calibrate.add_parser(sub)
    sub.add_parser("sim", help="replay a trace on a cluster file in the simulator, policy against policy "
                   "(--help: more)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.command == "up":
        from hetmesh.launcher.__main__ import main as up

        return up(rest)
    if args.command == "sim":
        from hetmesh.sim.__main__ import main as sim

        return sim(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "calibrate":
        return calibrate.run(args)
    if args.command == "plan" and args.live:
        return live(args)
    if args.command == "plan":
        try:
            return plan.run(args)
        except plan.PlanError as e:
            print(f"hetmesh plan: {e}", file=sys.stderr)
            return 2
    url = nats_url(args.nats, args.cluster)
    try:
        status = asyncio.run(fetch_status(url, args.timeout))
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        print(f"hetmesh: no scheduler answered on {subjects.SCHED_STATUS} at {url}", file=sys.stderr)
        return 2
    except TimeoutError:
        print(f"hetmesh: cannot reach NATS at {url}: no answer within {args.timeout * 2:g}s", file=sys.stderr)
        return 2
    except (OSError, nats.errors.Error) as exc:
        print(f"hetmesh: cannot reach NATS at {url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 2
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(status)).decode())
    else:
        Console(width=160).print(table(status))
        if args.tenants:
            Console(width=160).print(tenant_table(status))
        if (launched := runfile.find(url)) is not None:
            print(processes_line(launched))
    return 0


if __name__ == "__main__":
    sys.exit(main())
