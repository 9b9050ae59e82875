"""`hetmesh sim`: replay a trace on a cluster file under some policies (also `python -m hetmesh.sim`).

    hetmesh sim --cluster ops/clusters/seed-case-study.toml --policy cost,least_loaded \
        --closed-loop 24 --requests 2000 --input 2048 --output 512 --out results/sim.json --plots results/sim
    hetmesh sim --cluster my.toml --trace data/mooncake_synthetic_trace.jsonl --rate-sweep 0.5,1,2
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hetmesh import config, wiring
from hetmesh.costmodel import load_efficiencies
from hetmesh.protocol import Role
from hetmesh.sim import ClosedLoop, SimConfig, Slo, Trace, load, simulate, synthetic, workers_from_config
from hetmesh.sim.report import plot_cdfs, plot_lines, print_table, write_json


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def build_parser(prog: str = "hetmesh sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--cluster", help="cluster TOML (default: $HETMESH_CLUSTER or ops/clusters/default.toml)")
    p.add_argument("--role", choices=[r.value for r in Role],
                   help="override every worker's role (e.g. both, so the cost policy may choose)")
    p.add_argument("--policy", default="round_robin,least_loaded,prefix_aware,cost",
                   help="comma-separated policies to compare")
    p.add_argument("--objective", default="throughput", choices=["throughput", "latency"])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake JSONL or Azure CSV trace")
    src.add_argument("--closed-loop", type=int, metavar="N", help="N clients, each sends when its last answer ends")
    p.add_argument("--requests", type=int, default=1000, help="requests to replay / generate")
    p.add_argument("--rate", type=float, default=2.0, help="synthetic open-loop arrival rate (req/s)")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "bursty", "uniform"])
    p.add_argument("--input", type=_ints, default=[1024], help="prompt length (comma list: drawn uniformly)")
    p.add_argument("--output", type=_ints, default=[256], help="output length (comma list: drawn uniformly)")
    p.add_argument("--dist", default="lognormal", choices=["fixed", "uniform", "lognormal", "exponential"],
                   help="synthetic length distribution around --input/--output")
    p.add_argument("--prefix-groups", type=int, default=0, help="synthetic shared-prefix groups")
    p.add_argument("--prefix-tokens", type=int, default=0, help="shared prefix length of each group")
    p.add_argument("--rate-sweep", type=lambda s: [float(x) for x in s.split(",")],
                   help="replay the trace at these arrival-rate multiples (throughput vs load plot)")
    p.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO s (default: the cluster file's)")
    p.add_argument("--tpot-slo", type=float, default=None, help="TPOT SLO s (default: the cluster file's)")
    p.add_argument("--efficiency", help="efficiency factors JSON (hetmesh.costmodel.save_efficiencies)")
    p.add_argument("--step-tokens", type=int, help="every worker's step budget (default: the cluster file's)")
    p.add_argument("--out", help="write the summaries to this JSON file")
    p.add_argument("--plots", help="write PNG plots with this path prefix")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _trace(a: argparse.Namespace) -> Trace | ClosedLoop:
    if a.trace:
        return load(a.trace, a.requests)
    if a.closed_loop:
        return ClosedLoop(concurrency=a.closed_loop, total=a.requests, input_len=a.input if len(a.input) > 1
                          else a.input[0], output_len=a.output if len(a.output) > 1 else a.output[0],
                          shared_prefix_tokens=a.prefix_tokens)
    return synthetic(a.requests, a.rate, input_mean=a.input[0], output_mean=a.output[0], input_dist=a.dist,
                     output_dist=a.dist, arrival=a.arrival, prefix_groups=a.prefix_groups,
                     prefix_tokens=a.prefix_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = config.load(a.cluster)
    workers = workers_from_config(cfg)
    if a.role:
        workers = [dataclasses.replace(w, role=Role(a.role)) for w in workers]
    slo = Slo(a.ttft_slo if a.ttft_slo is not None else cfg.scheduler.ttft_slo_s,
              a.tpot_slo if a.tpot_slo is not None else cfg.scheduler.tpot_slo_s)
    if a.step_tokens:
        workers = [dataclasses.replace(w, step_tokens=a.step_tokens) for w in workers]
    simcfg = SimConfig(efficiencies=load_efficiencies(a.efficiency) if a.efficiency else wiring.efficiencies(cfg))
    base = _trace(a)
    rates = a.rate_sweep or [1.0]
    if a.rate_sweep and not isinstance(base, Trace):
        print("--rate-sweep needs an open-loop trace (--trace or synthetic)", file=sys.stderr)
        return 2
    policies = [x for x in a.policy.split(",") if x]
    console = Console(stderr=True)
    summaries: list[dict[str, Any]] = []
    results = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=a.quiet) as prog:
        for rate in rates:
            trace = base.scaled(rate) if isinstance(base, Trace) and rate != 1.0 else base
            for name in policies:
                task = prog.add_task(f"{name} x{rate:g}", total=a.requests)
                kw = dict(cfg.scheduler.options) if name == cfg.scheduler.policy else {}
                if name == "cost":
                    kw["objective"] = a.objective
                s, res = simulate(workers, name, trace, simcfg, slo,
                                  progress=lambda done, total, t=task: prog.update(t, completed=done, total=total),
                                  **kw)
                s["label"] = name if len(rates) == 1 else f"{name} x{rate:g}"
                s["rate_factor"] = rate
                summaries.append(s)
                if rate == rates[-1]:
                    results[name] = res
    print_table(summaries, title=f"hetmesh sim: {a.cluster or 'default cluster'}")
    if a.out:
        write_json(a.out, {"cluster": a.cluster, "slo": dataclasses.asdict(slo), "runs": summaries})
    if a.plots:
        plot_cdfs(f"{a.plots}_latency_cdf.png", results)
        if len(rates) > 1:
            plot_lines(f"{a.plots}_throughput_vs_load.png", rates,
                       {n: [s["output_tok_s"] for s in summaries if s["policy"] == n] for n in policies},
                       "arrival rate (x trace)", "output tok/s", "throughput vs load")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
