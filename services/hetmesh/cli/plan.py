"""`hetmesh plan`: the planner from the command line.

    hetmesh plan --fleet ops/clusters/seed-case-study.toml --trace data/mooncake_synthetic_trace.jsonl
    hetmesh plan --fleet my.toml --rate 2 --input 2048 --output 256 --out /tmp/plans
    hetmesh plan --catalog --spec llama-3.1-70b --rate 8 --slo 2,0.1 --budget 200

--fleet: the best layout of the servers in a cluster file (its worker groups, their current model and
role) for the demand, as tables, and in OUT/plan/ a JSON file, a PNG and a cluster file ready for
`hetmesh up`. --catalog: the cheapest servers to buy that meet the SLOs, and the Pareto front ($/hour
vs goodput), in OUT/buy/. OUT is --out (default ./hetmesh-out). The demand is a trace (--trace; every
request for the one model, or each naming its model) or a synthetic description (--rate, --input,
--output mean lengths). What is being simulated goes to stderr (a line per step when it is not a
terminal). Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import textwrap
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import tomli_w
from rich.console import Console
from rich.table import Table

from hetmesh import config, wiring
from hetmesh.costmodel import accelerators, model_spec
from hetmesh.costmodel.economics import assumed_prices
from hetmesh.planner import ModelDemand, Plan, ServerGroup, demand_from_trace, plan, report
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
    p.add_argument("--price", action="append", default=[], metavar="ACCELERATOR=USD",
                   help="your $ per device-hour for an accelerator, over the catalog's and the cluster file's "
                        "(repeatable)")
    p.add_argument("--out", default="hetmesh-out", help="folder for the results: plan/ (--fleet: plan.json, "
                   "plan.png, cluster.toml) or buy/ (--catalog: plan.json, pareto.png); default ./hetmesh-out")


def _prices(args: argparse.Namespace, base: dict[str, float] | None = None) -> dict[str, float]:
    """The cluster file's [prices] (`base`) with --price ACCELERATOR=USD over them."""
    out = dict(base or {})
    known = accelerators()
    for item in args.price:
        acc, _, usd = item.partition("=")
        if acc not in known:
            raise PlanError(f"--price {item!r}: unknown accelerator {acc!r}; choose from {', '.join(sorted(known))}")
        try:
            out[acc] = float(usd)
        except ValueError:
            raise PlanError(f"--price {item!r}: want ACCELERATOR=USD per device-hour, e.g. {acc}=2.5") from None
    return out


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
    cfg.prices = _prices(args, cfg.prices)
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
    t = Table(title=f"plan: the {p.chosen} layout, goodput {p.predicted['goodput_tok_s']:,.1f} tok/s (simulated)")
    for col in ("group", "model", "role", "parallel", "servers"):
        t.add_column(col)
    for (group, model, role, parallel), n in sorted(p.layout().items()):
        t.add_row(group, model, str(role), parallel, str(n))
    return t


def _candidates_table(p: Plan) -> Table:
    t = Table(title="candidate layouts, simulated",
              caption="score: goodput weighted by model priority, less what the moves cost; the plan keeps the "
                      "best score (at a tie within 1%: the current layout, then the cheaper)")
    for col, justify in [("layout", "left"), ("how it was found", "left"), ("goodput tok/s", "right"),
                         ("SLO attainment", "right"), ("refused", "right"), ("$/h", "right"), ("score", "right")]:
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for c in p.candidates:
        t.add_row(c.name + (" (chosen)" if c.name == p.chosen else ""), c.what, f"{c.goodput_tok_s:,.1f}",
                  f"{c.slo_attainment:.1%}", f"{c.refused:,} of {c.offered:,}", f"{c.usd_per_hour:,.2f}",
                  f"{c.score:,.1f}")
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
    prices = _prices(args)
    best = cheapest(kinds, [d], trace=tr, attainment=args.attainment, prices=prices, progress=progress)
    if best is None or not best.meets:
        raise PlanError(f"no mix of up to {args.max_servers} servers of {', '.join(ids)} meets TTFT {ttft:g}s / "
                        f"TPOT {tpot:g}s at {args.attainment:.0%}: relax the SLOs or allow more servers or chips")
    top = args.budget or best.usd_per_hour * 2
    front = pareto(kinds, [d], [top * f for f in (0.25, 0.5, 0.75, 1.0)], trace=tr, prices=prices, progress=progress)
    return best, front


def _plot_fleet(path: Path, p: Plan) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cs = p.candidates
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.7 * len(cs)))
    ys = range(len(cs))[::-1]
    ax.barh(list(ys), [c.goodput_tok_s for c in cs], color=["C1" if c.name == p.chosen else "C0" for c in cs])
    ax.set_yticks(list(ys), ["\n".join(textwrap.wrap(f"{c.name}: {c.what}", 40)) for c in cs], fontsize=8)
    for y, c in zip(ys, cs, strict=True):
        ax.text(c.goodput_tok_s, y, f" {c.goodput_tok_s:,.0f} tok/s, {c.slo_attainment:.0%} in SLO, "
                f"${c.usd_per_hour:,.0f}/h", va="center", fontsize=8)
    ax.set_xlim(0, max((c.goodput_tok_s for c in cs), default=1.0) * 1.6 or 1.0)
    ax.set_xlabel("simulated SLO goodput (output tokens/s)")
    ax.set_title("candidate layouts of the fleet")
    ax.legend(handles=[Patch(color="C1", label="chosen"), Patch(color="C0", label="other candidates")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(cs)), ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_buy(path: Path, front: list[Purchase], best: Purchase, devices: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot([f.usd_per_hour for f in front], [f.goodput_tok_s for f in front], "o-", color="C0",
            label="Pareto front: the most goodput each budget buys")
    for f in front:
        ax.annotate(report.servers(f.servers), (f.usd_per_hour, f.goodput_tok_s), textcoords="offset points",
                    xytext=(6, -10), fontsize=7)
    ax.plot([best.usd_per_hour], [best.goodput_tok_s], "*", color="C3", ms=14,
            label=f"cheapest meeting the SLOs: {report.servers(best.servers)}")
    ax.set_xlabel("fleet price ($ per hour)")
    ax.set_ylabel("simulated SLO goodput (output tokens/s)")
    ax.set_title(f"servers to buy ({devices} devices each): price against goodput")
    ax.margins(x=0.25, y=0.1)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def _progress(stage: str) -> Iterator[Callable[[str], None]]:
    """What is being simulated, on stderr: a live status line on a terminal, else a line per step."""
    err = Console(stderr=True)
    if err.is_terminal:
        with err.status(stage, spinner="dots") as st:
            yield lambda what: st.update(f"{stage}: {what}")
        return
    t0 = time.monotonic()

    def say(what: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {stage}: {what}", file=sys.stderr, flush=True)

    yield say


def run(args: argparse.Namespace) -> int:
    console = Console(width=160)
    if args.fleet:
        with _progress("planning") as say:
            p, cfg = fleet(args, say)
        console.print(_fleet_table(p))
        for line in report.summary(p.predicted):
            console.print(line, soft_wrap=True, markup=False)
        console.print(_candidates_table(p))
        for line in report.price_lines({a.accelerator for a in p.assignments if a.model}, "runs on", cfg.prices):
            console.print(line, soft_wrap=True, markup=False)
        for m in p.moves:
            console.print(f"move {m.server}: {m.before} -> {m.after} ({m.change}, {m.seconds:.0f} s out)")
        for line in _afd_lines(cfg):
            console.print(line, soft_wrap=True, markup=False)
        out = Path(args.out) / "plan"
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_bytes(msgspec.json.format(msgspec.json.encode(p)))
        (out / "cluster.toml").write_text(cluster_file(p, cfg, args.fleet))
        _plot_fleet(out / "plan.png", p)
        console.print(f"wrote {out}/plan.json, plan.png, cluster.toml (hetmesh up --cluster {out}/cluster.toml)",
                      soft_wrap=True, markup=False)
        return 0
    with _progress("capacity planning") as say:
        best, front = catalog(args, say)
    assert best is not None
    t = Table(title="cheapest servers meeting the SLOs")
    for col, justify in [("accelerator", "left"), ("servers", "right")]:
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for k, n in sorted(best.servers.items()):
        t.add_row(k, str(n))
    console.print(t)
    console.print(f"${best.usd_per_hour:,.2f}/h, goodput {best.goodput_tok_s:,.1f} tok/s; "
                  + report.attainment(best.slo_attainment, best.refused, best.offered), soft_wrap=True, markup=False)
    f = Table(title="Pareto front: the most goodput each budget buys (simulated)")
    for col, justify in [("$/h", "right"), ("goodput tok/s", "right"), ("SLO attainment", "right"),
                         ("refused", "right"), ("servers", "left")]:
        f.add_column(col, justify=justify)  # type: ignore[arg-type]
    prices = _prices(args)
    assumed = assumed_prices(accelerators(), prices)
    for q in front:
        f.add_row(f"{q.usd_per_hour:,.2f}", f"{q.goodput_tok_s:,.1f}", f"{q.slo_attainment:.1%}",
                  f"{q.refused:,} of {q.offered:,}", report.servers(q.servers, assumed))
    if any(k in assumed for q in front for k in q.servers):
        f.caption = "* its price is assumed, not listed"
    console.print(f)
    for line in report.price_lines(best.servers, "buys", prices):
        console.print(line, soft_wrap=True, markup=False)
    out = Path(args.out) / "buy"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps({"cheapest": msgspec.to_builtins(best),
                                               "pareto": msgspec.to_builtins(front)}, indent=1))
    _plot_buy(out / "pareto.png", front, best, args.devices)
    console.print(f"wrote {out}/plan.json, pareto.png", soft_wrap=True, markup=False)
    return 0
