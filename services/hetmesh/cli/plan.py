"""`hetmesh plan`: the planner from the command line.

    hetmesh plan --fleet ops/clusters/seed-case-study.toml --trace data/mooncake_synthetic_trace.jsonl
    hetmesh plan --fleet my.toml --rate 2 --input 2048 --output 256 --out plan/
    hetmesh plan --catalog --spec llama-3.1-70b --rate 8 --slo 2,0.1 --budget 200 --out buy/

--fleet: the best layout of the servers in a cluster file (its worker groups, their current model and
role) for the demand, as a table, a JSON file, a PNG and a cluster file ready for `hetmesh up`.
--catalog: the cheapest servers to buy that meet the SLOs, and the Pareto front ($/hour vs goodput).
The demand is a trace (--trace; every request for the one model, or each naming its model) or a
synthetic description (--rate, --input, --output mean lengths). Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import tomli_w
from rich.console import Console
from rich.table import Table

from hetmesh import config, wiring
from hetmesh.costmodel import accelerators, model_spec
from hetmesh.planner import ModelDemand, Plan, ServerGroup, demand_from_trace, plan
from hetmesh.planner.buy import Purchase, cheapest, pareto
from hetmesh.sim.traces import Trace, load


class PlanError(Exception):
    """Bad input: the message says what to change."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="lay out a fleet, or choose chips to buy, for a demand",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--fleet", metavar="CLUSTER_TOML", help="plan the servers of this cluster file")
    what.add_argument("--catalog", action="store_true", help="capacity planning over the accelerator catalog")
    what.add_argument("--live", action="store_true", help="the running planner's last proposal: current vs "
                      "proposed layout (--nats URL, or $HETMESH_NATS_URL)")
    p.add_argument("--nats", help="--live: NATS URL of the mesh")
    p.add_argument("--trace", help="demand from a trace (Mooncake JSONL or Azure CSV)")
    p.add_argument("--rate", type=float, help="synthetic demand: requests per second")
    p.add_argument("--input", type=float, default=2048, help="synthetic demand: mean prompt tokens")
    p.add_argument("--output", type=float, default=256, help="synthetic demand: mean output tokens")
    p.add_argument("--model", help="the model the trace asks for (default: the cluster file's first)")
    p.add_argument("--spec", default="llama-3.1-70b", help="--catalog: the model's cost-model spec")
    p.add_argument("--slo", default="2,0.1", help="--catalog: TTFT,TPOT seconds")
    p.add_argument("--accelerators", help="--catalog: accelerator ids to consider (default: all)")
    p.add_argument("--devices", type=int, default=8, help="--catalog: devices per server")
    p.add_argument("--max-servers", type=int, default=32, help="--catalog: most servers of one kind")
    p.add_argument("--budget", type=float, help="--catalog: $/hour cap of the Pareto front")
    p.add_argument("--attainment", type=float, default=0.9, help="--catalog: SLO attainment that counts as met")
    p.add_argument("--out", help="folder for plan.json, plan.png and (with --fleet) cluster.toml")


def _trace(path: str) -> Trace:
    if not Path(path).is_file():
        raise PlanError(f"trace {path} not found")
    tr = load(path)
    if not tr.requests:
        raise PlanError(f"trace {path} has no requests")
    return tr


def _demands_fleet(cfg: config.ClusterConfig, args: argparse.Namespace, tr: Trace | None) -> list[ModelDemand]:
    names = [args.model] if args.model else [m.name for m in cfg.models]
    out = []
    for name in names:
        try:
            m = cfg.model(name)
        except KeyError as e:
            raise PlanError(str(e.args[0])) from None
        ttft, tpot = cfg.slo(name)
        if tr is not None:
            if not any(r.model in ("", name) for r in tr.requests):
                continue
            out.append(demand_from_trace(tr, name=name, spec=m.spec, ttft_slo_s=ttft, tpot_slo_s=tpot,
                                         priority=m.priority, dtype=m.dtype))
        else:
            out.append(ModelDemand(name=name, spec=m.spec, rate=args.rate, input_mean=args.input,
                                   output_mean=args.output, ttft_slo_s=ttft, tpot_slo_s=tpot, priority=m.priority,
                                   dtype=m.dtype))
        if tr is not None and all(not r.model for r in tr.requests):
            break  # a one-model trace is the first (or --model) model's
    if not out:
        raise PlanError("the trace asks for none of the cluster file's models")
    return out


def fleet(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> tuple[Plan, config.ClusterConfig]:
    try:
        cfg = config.load(args.fleet)
    except (OSError, ValueError, msgspec.ValidationError) as e:
        raise PlanError(f"cluster file {args.fleet}: {e}") from None
    tr = _trace(args.trace) if args.trace else None
    if tr is None and not args.rate:
        raise PlanError("give the demand: --trace FILE or --rate R (with --input/--output means)")
    groups = [ServerGroup(name=g.name, accelerator=g.accelerator, devices=g.devices, count=g.count, model=g.model,
                          role=g.role, parallel=g.parallel, max_batch=g.max_batch, step_tokens=g.step_tokens)
              for g in cfg.workers]
    demands = _demands_fleet(cfg, args, tr)
    if tr is not None:  # requests without a model ask for the one model planned
        name = demands[0].name
        tr = Trace([r if r.model else dataclasses.replace(r, model=name) for r in tr.requests], tr.block_tokens,
                   tr.name)
    try:
        return plan(groups, demands, trace=tr, prices=cfg.prices, efficiencies=wiring.efficiencies(cfg),
                    progress=progress), cfg
    except ValueError as e:
        raise PlanError(str(e)) from None


def cluster_file(p: Plan, cfg: config.ClusterConfig, source: str) -> str:
    """The cluster file `source` (as written, without environment overrides such as secrets) with its
    worker groups replaced by the plan's layout: one group per (group, model, role, layout)."""
    old = {g.name: g for g in cfg.workers}
    raw = tomllib.loads(Path(source).read_text())
    raw["workers"] = [msgspec.to_builtins(msgspec.structs.replace(
        old[group], name=f"{group}-{model}-{role}-{parallel}".replace(".", "_"), model=model, role=role,
        parallel=parallel, count=n)) for (group, model, role, parallel), n in sorted(p.layout().items())]
    return tomli_w.dumps(raw)


def _fleet_table(p: Plan) -> Table:
    chosen = next(c for c in p.candidates if c.name == p.chosen)
    t = Table(title=f"plan: the {p.chosen} layout (simulated weighted SLO goodput {chosen.score:.1f} tok/s; "
              + ", ".join(f"{c.name} {c.score:.1f}" for c in p.candidates) + ")")
    for col in ("group", "model", "role", "parallel", "servers"):
        t.add_column(col)
    for (group, model, role, parallel), n in sorted(p.layout().items()):
        t.add_row(group, model, str(role), parallel, str(n))
    return t


def _afd_lines(cfg: config.ClusterConfig) -> list[str]:
    """The attention-FFN disaggregation what-if for each MoE model over each pair of the fleet's chips."""
    from hetmesh.costmodel.afd import what_if

    accs = sorted({g.accelerator for g in cfg.workers})
    devices = max((g.devices for g in cfg.workers), default=8)
    out = []
    for m in cfg.models:
        if not model_spec(m.spec).is_moe:
            continue
        _, tpot = cfg.slo(m.name)
        for attn in accs:
            for ffn in accs:
                if attn == ffn:
                    continue
                w = what_if(m.spec, attn, ffn, devices=devices, tpot_slo_s=tpot, prices=cfg.prices)
                out.append(f"what-if {m.name}: attention on {attn}, FFN on {ffn}: {w.tok_per_usd:,.0f} tokens/$ "
                           f"vs {w.single_tok_per_usd:,.0f} on {w.best_single or 'neither'} alone "
                           f"({'pays' if w.pays > 1 else 'does not pay'}: x{w.pays:.2f})")
    return out


def catalog(args: argparse.Namespace,
            progress: Callable[[str], None] | None = None) -> tuple[Purchase | None, list[Purchase]]:
    known = accelerators()
    ids = [a for a in (args.accelerators or "").split(",") if a] or sorted(known)
    for a in ids:
        if a not in known:
            raise PlanError(f"unknown accelerator {a!r}; choose from {', '.join(sorted(known))}")
    try:
        model_spec(args.spec)
    except KeyError as e:
        raise PlanError(str(e.args[0])) from None
    try:
        ttft, tpot = (float(x) for x in args.slo.split(","))
    except ValueError:
        raise PlanError(f"--slo {args.slo!r}: want TTFT,TPOT seconds, e.g. 2,0.1") from None
    tr = _trace(args.trace) if args.trace else None
    if tr is not None:
        d = demand_from_trace(tr, name=args.spec, spec=args.spec, ttft_slo_s=ttft, tpot_slo_s=tpot)
        tr = Trace([dataclasses.replace(r, model=args.spec) for r in tr.requests], tr.block_tokens, tr.name)
    elif args.rate:
        d = ModelDemand(name=args.spec, spec=args.spec, rate=args.rate, input_mean=args.input,
                        output_mean=args.output, ttft_slo_s=ttft, tpot_slo_s=tpot)
    else:
        raise PlanError("give the demand: --trace FILE or --rate R (with --input/--output means)")
    kinds = [ServerGroup(name=a, accelerator=a, devices=args.devices, count=args.max_servers) for a in ids]
    best = cheapest(kinds, [d], trace=tr, attainment=args.attainment, progress=progress)
    if best is None or not best.meets:
        raise PlanError(f"no mix of up to {args.max_servers} servers of {', '.join(ids)} meets TTFT {ttft:g}s / "
                        f"TPOT {tpot:g}s at {args.attainment:.0%}: relax the SLOs or allow more servers or chips")
    top = args.budget or best.usd_per_hour * 2
    front = pareto(kinds, [d], [top * f for f in (0.25, 0.5, 0.75, 1.0)], trace=tr, progress=progress)
    return best, front


def _plot(path: Path, front: list[Purchase], best: Purchase | None = None, p: Plan | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if p is not None:
        names = [c.name for c in p.candidates]
        ax.bar(names, [c.score for c in p.candidates], color=["C1" if n == p.chosen else "C0" for n in names])
        ax.set_ylabel("simulated weighted SLO goodput (tok/s)")
        ax.set_title("candidate layouts")
    else:
        ax.plot([f.usd_per_hour for f in front], [f.goodput_tok_s for f in front], "o-", label="Pareto front")
        if best is not None:
            ax.plot([best.usd_per_hour], [best.goodput_tok_s], "r*", ms=12, label="cheapest meeting the SLOs")
        ax.set_xlabel("$ / hour")
        ax.set_ylabel("simulated SLO goodput (tok/s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    console = Console(width=140)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if args.fleet:
        with console.status("planning", spinner="dots") as st:
            p, cfg = fleet(args, lambda what: st.update(f"planning: {what}"))
        console.print(_fleet_table(p))
        pr = p.predicted
        console.print(f"goodput {pr['goodput_tok_s']:.1f} tok/s, SLO attainment {pr['slo_attainment']:.1%}, "
                      f"${pr['usd_per_hour']:.2f}/h, ${pr['usd_per_good_mtok']:.2f} per million good tokens")
        for m in p.moves:
            console.print(f"move {m.server}: {m.before} -> {m.after} ({m.change}, {m.seconds:.0f} s out)")
        for line in _afd_lines(cfg):
            console.print(line)
        if out:
            (out / "plan.json").write_bytes(msgspec.json.format(msgspec.json.encode(p)))
            (out / "cluster.toml").write_text(cluster_file(p, cfg, args.fleet))
            _plot(out / "plan.png", [], p=p)
            console.print(f"wrote {out}/plan.json, plan.png, cluster.toml")
        return 0
    with console.status("capacity planning", spinner="dots") as st:
        best, front = catalog(args, lambda what: st.update(f"capacity planning: {what}"))
    assert best is not None
    t = Table(title="cheapest servers meeting the SLOs")
    for col in ("accelerator", "servers"):
        t.add_column(col)
    for k, n in sorted(best.servers.items()):
        t.add_row(k, str(n))
    console.print(t)
    console.print(f"${best.usd_per_hour:.2f}/h, goodput {best.goodput_tok_s:.1f} tok/s, "
                  f"SLO attainment {best.slo_attainment:.1%}")
    for f in front:
        console.print(f"  budget front: ${f.usd_per_hour:.2f}/h -> {f.goodput_tok_s:.1f} tok/s {f.servers}")
    if out:
        (out / "plan.json").write_text(json.dumps({"cheapest": msgspec.to_builtins(best),
                                                   "pareto": msgspec.to_builtins(front)}, indent=1))
        _plot(out / "pareto.png", front, best)
        console.print(f"wrote {out}/plan.json, pareto.png")
    return 0
