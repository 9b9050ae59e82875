"""The cost policy learning each worker's speed online, in the simulator: wrong priors, and a worker that drifts.

Wrong priors. On the anchors benchmark's clusters (benchmarks/anchors.py: seed, rubin, mix), each accelerator
kind's true factors are drawn per seed at 0.5-1.5x its prior: compute and memory independently, overhead_s and
per_seq_s divided by a third draw (a kind 1.5x faster has 1/1.5 of the overheads). Every worker runs at its
kind's truth (hetmesh.costmodel.truth.Truth); the scheduler prices the prior. The cluster's TRUE capacity
(anchors.capacity on the true workers), loads of 0.8x, 1.0x and 1.5x of it, one trace per cluster. Per point:

- cost, learning: the cost policy (config defaults) learning from the prior (hetmesh.costmodel.learn)
- cost, prior only: the same with learning off (the scheduler believes the prior throughout)
- cost, oracle: the cost policy given the true factors, learning off
- best anchor: the best goodput over the llm-d and Dynamo configurations of anchors.anchor_runs() (no model of speed)

Targets per point: learning >= 95% of the oracle's goodput and >= 1.0x the best anchor's.

Drift. A pool of 4x 8xH100 serving Llama-3.1-70B (every worker `both`) on the Azure conversation trace at 70%
of its capacity; one worker's steps take 2x longer from T = 60 s of engine time on (Truth(slowdown=2.0)). Per run
(cost learning, cost with learning off): (a) that worker's prediction error on each report's steps, predicted
before the report is folded in (|predicted / observed - 1|, median over the report): when it is back within 15%
for good; (b) its share of placements before T, in [T, T+30 s) and after; (c) SLO attainment per 10 s window of
arrivals (met / offered, refusals count as missed): when it is back within 5 points of its level before T for
good. Targets: (a) <= 30 s, (b) the share falls, (c) <= 60 s.

Prints the tables; writes results/learning.json.
    nice .venv/bin/python benchmarks/learning.py [--seeds 1 2 3 4 5 6 7 8] [--span 60] [--jobs 2] [--only mix]
        [--skip-drift] [--out /tmp/learning.json]   (a subset: write it elsewhere)
    nice .venv/bin/python benchmarks/learning.py --tables   (print the tables of results/learning.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from anchors import CLUSTERS, TRACES, _row, anchor_runs, capacity, offered
from rich.console import Console
from rich.table import Table

from hetmesh.config import SchedulerConfig
from hetmesh.costmodel import Efficiency, load_efficiencies
from hetmesh.costmodel.calibrate import server_model
from hetmesh.costmodel.learn import StepSample, features, predict, theta_of
from hetmesh.costmodel.truth import Truth
from hetmesh.sim import SimConfig, Slo, Trace, WorkerSpec, load, policy_for, pool, simulate
from hetmesh.sim.report import write_json
from hetmesh.sim.traces import DATA_DIR

ROOT = Path(__file__).resolve().parents[1]
LOADS = (0.8, 1.0, 1.5)
TRACE_OF = {"seed": "mooncake", "rubin": "azure-conv", "mix": "azure-conv"}  # one trace per cluster
SPREAD = (0.5, 1.5)  # each true factor at this range of times its prior
ANCHORS = ("llm_d", "dynamo")  # of anchors.anchor_runs(): the routers with no model of speed at all
ORACLE_SHARE = 0.95  # target: learning's goodput over the oracle's
ANCHOR_X = 1.0  # target: learning's goodput over the best anchor's
# drift
DRIFT_WORKERS = 4
DRIFT_LOAD = 0.7
DRIFT_AT_S = 60.0
DRIFT_SPAN_S = 180.0
DRIFT_SLO = Slo(ttft_s=2.0, tpot_s=0.1)
WINDOW_S = 10.0
PRED_OK = 0.15  # target (a): predictions back within 15% ...
PRED_WITHIN_S = 30.0  # ... in this many seconds
SLO_DIP = 0.05  # (c) a window is recovered when within 5 points of the attainment before the slowdown ...
SLO_WITHIN_S = 60.0  # ... for good, this many seconds after it


# a typical mixed step (a 512-token prefill chunk beside 16 decodes at 2,048 tokens of context): speeds are read on it
REF = StepSample(512, 1, 512 * 513 / 2, 0, 16, 16 * 2048, 0.0)


def speed(pol: Any, wid: str, against: Efficiency) -> float:
    """How fast the policy believes the worker runs against `against` on REF (> 1: faster); nan if unknown."""
    lr = pol.learner
    fit, cm = lr.fits.get(wid), lr.models.get(wid)
    if fit is None or cm is None:
        return math.nan
    f = features(cm, [REF])
    return float(predict(f, theta_of(against))[0] / predict(f, fit.theta)[0])


# ---------------------------------------------------------------- wrong priors
def _cfg(cname: str) -> SimConfig:
    return SimConfig(efficiencies=load_efficiencies(ROOT / "results" / "seed_efficiency.json") if cname == "seed"
                     else {})


def priors(cname: str) -> dict[str, Efficiency]:
    """Each accelerator kind's prior (what the scheduler prices), as the simulator resolves it."""
    cfg = _cfg(cname)
    out: dict[str, Efficiency] = {}
    for w in CLUSTERS[cname][1]("both"):
        out.setdefault(w.accelerator, server_model(w.accelerator, w.spec, devices=w.devices, parallel=w.parallel,
                                                   dtype=w.dtype, efficiencies=cfg.efficiencies).eff)
    return out


def draw(cname: str, seed: int) -> tuple[dict[str, Efficiency], dict[str, dict[str, float]]]:
    """Each kind's true factors, and the draws (x prior; the overheads are divided by `overhead`)."""
    rng = np.random.default_rng([seed, sorted(CLUSTERS).index(cname)])
    truth, draws = {}, {}
    for accel, p in sorted(priors(cname).items()):
        c, m, o = rng.uniform(*SPREAD, size=3)
        truth[accel] = Efficiency(compute=min(p.compute * c, 1.5), memory=min(p.memory * m, 1.5),
                                  overhead_s=p.overhead_s / o, per_seq_s=p.per_seq_s / o)
        draws[accel] = {"compute": float(c), "memory": float(m), "overhead": float(o)}
    return truth, draws


def _anchor_runs() -> list[tuple[str, str, str, dict[str, Any]]]:
    return [a for a in anchor_runs() if a[0] in ANCHORS]


def _true_build(cname: str, truth: dict[str, Efficiency]) -> Any:
    build = CLUSTERS[cname][1]

    def b(layout: str) -> list[WorkerSpec]:
        return [dataclasses.replace(w, truth=Truth(efficiency=truth[w.accelerator])) for w in build(layout)]
    return b


@cache
def _trace(cname: str, data: str, max_requests: int) -> Trace:
    return load(Path(data) / TRACES[TRACE_OF[cname]], limit=max_requests)


def cap_task(cname: str, seed: int, data: str, max_requests: int) -> dict[str, Any]:
    truth, draws = draw(cname, seed)
    slo, cfg, trace = CLUSTERS[cname][2], _cfg(cname), _trace(cname, data, max_requests)
    t0 = time.time()
    caps = capacity(_true_build(cname, truth), trace, cfg, slo)
    prior_caps = capacity(CLUSTERS[cname][1], trace, cfg, slo)
    return {"cluster": cname, "seed": seed, "draws": draws, "closed_loop_req_s": caps,
            "capacity_req_s": max(caps.values()), "prior_capacity_req_s": max(prior_caps.values()),
            "wall_s": time.time() - t0}


def point_task(cname: str, seed: int, load_x: float, cap: float, span: float, data: str,
               max_requests: int) -> dict[str, Any]:
    t0 = time.time()
    truth, _ = draw(cname, seed)
    build, slo, cfg = _true_build(cname, truth), CLUSTERS[cname][2], _cfg(cname)
    sc = SchedulerConfig()
    trace = _trace(cname, data, max_requests)
    trace = trace.head(int(min(max(cap * span, 300), max_requests)))
    natural = len(trace) / max(trace.requests[-1].arrival - trace.requests[0].arrival, 1e-9)
    tr = trace.scaled(load_x * cap / natural)
    ws = {"both": build("both"), "static": build("static")}
    kw = {"objective": sc.objective, "admission_margin": sc.admission_margin}
    out: dict[str, Any] = {"cluster": cname, "seed": seed, "load": load_x, "rate_req_s": load_x * cap,
                           "requests": len(tr), "offered_tok_s": offered(tr)}
    pol = policy_for("cost", ws["both"], slo, efficiencies=cfg.efficiencies, **kw)
    s, _ = simulate(ws["both"], pol, tr, cfg, slo)
    out["learning"] = _row(s, tr, "cost, learning", "both")
    # how far each worker's learned speed ended from its truth (on the learner's reference step)
    out["learned_speed_error"] = {w.worker_id: abs(speed(pol, w.worker_id, truth[w.accelerator]) - 1.0)
                                  for w in ws["both"]}
    prior = priors(cname)
    out["prior_speed_error"] = {}
    for w in ws["both"]:
        f = features(server_model(w.accelerator, w.spec, devices=w.devices, parallel=w.parallel, dtype=w.dtype,
                                  efficiencies=cfg.efficiencies), [REF])
        out["prior_speed_error"][w.worker_id] = abs(float(predict(f, theta_of(truth[w.accelerator]))[0]
                                                          / predict(f, theta_of(prior[w.accelerator]))[0]) - 1.0)
    s, _ = simulate(ws["both"], "cost", tr, cfg, slo, learn=False, **kw)
    out["prior"] = _row(s, tr, "cost, prior only", "both")
    s, _ = simulate(ws["both"], "cost", tr, cfg, slo, efficiencies=truth, learn=False, **kw)
    out["oracle"] = _row(s, tr, "cost, oracle", "both")
    for anchor, label, layout, akw in _anchor_runs():
        s, _ = simulate(ws[layout], anchor, tr, cfg, slo, **akw)
        r = _row(s, tr, label, layout)
        if "anchor" not in out or r["goodput_tok_s"] > out["anchor"]["goodput_tok_s"]:
            out["anchor"] = r
    g = {k: out[k]["goodput_tok_s"] for k in ("learning", "prior", "oracle", "anchor")}
    out["learning_x_oracle"] = g["learning"] / max(g["oracle"], 1e-9)
    out["prior_x_oracle"] = g["prior"] / max(g["oracle"], 1e-9)
    out["learning_x_anchor"] = g["learning"] / max(g["anchor"], 1e-9)
    out["prior_x_anchor"] = g["prior"] / max(g["anchor"], 1e-9)
    out["oracle_x_anchor"] = g["oracle"] / max(g["anchor"], 1e-9)
    out["wall_s"] = time.time() - t0
    return out


def wrong_priors(args: argparse.Namespace, console: Console, pool_: ProcessPoolExecutor) -> dict[str, Any]:
    clusters = [c for c in CLUSTERS if not args.only or c in args.only]
    caps = {(c, s): pool_.submit(cap_task, c, s, args.data, args.max_requests) for c in clusters for s in args.seeds}
    futs = {}
    res: dict[str, Any] = {"loads": LOADS, "seeds": args.seeds, "span_s": args.span, "spread": SPREAD,
                           "anchor_runs": [a[1] for a in _anchor_runs()], "clusters": {}}
    for (c, s), f in caps.items():
        cr = f.result()
        console.print(f"{c} seed {s}: true capacity {cr['capacity_req_s']:.2f} req/s (prior "
                      f"{cr['prior_capacity_req_s']:.2f}); draws " + ", ".join(
                          f"{a} c{d['compute']:.2f} m{d['memory']:.2f} o{d['overhead']:.2f}"
                          for a, d in cr["draws"].items()))
        cres = res["clusters"].setdefault(c, {"cluster": CLUSTERS[c][0], "trace": TRACE_OF[c],
                                              "slo": dataclasses.asdict(CLUSTERS[c][2]), "seeds": {}})
        cres["seeds"][str(s)] = {**cr, "points": []}
        for x in LOADS:
            futs[(c, s, x)] = pool_.submit(point_task, c, s, x, cr["capacity_req_s"], args.span, args.data,
                                           args.max_requests)
    t0 = time.time()
    for (c, s, x), f in futs.items():
        p = f.result()
        res["clusters"][c]["seeds"][str(s)]["points"].append(p)
        console.print(f"{c} seed {s} {x:g}x: learning {p['learning']['goodput_tok_s']:.0f}, prior "
                      f"{p['prior']['goodput_tok_s']:.0f}, oracle {p['oracle']['goodput_tok_s']:.0f}, best anchor "
                      f"{p['anchor']['goodput_tok_s']:.0f} ({p['anchor']['label']})  [{p['wall_s']:.0f}s, "
                      f"{time.time() - t0:.0f}s]")
    res["verdict"] = wp_verdict(res)
    return res


def wp_verdict(res: dict[str, Any]) -> dict[str, Any]:
    misses = []
    for c, cr in res["clusters"].items():
        for s, sr in cr["seeds"].items():
            for p in sr["points"]:
                if round(p["learning_x_oracle"], 2) < ORACLE_SHARE:
                    misses.append(f"{c} seed {s} {p['load']:g}x: learning {100 * p['learning_x_oracle']:.1f}% of "
                                  f"the oracle")
                if round(p["learning_x_anchor"], 2) < ANCHOR_X:
                    misses.append(f"{c} seed {s} {p['load']:g}x: learning {p['learning_x_anchor']:.2f}x the best "
                                  f"anchor ({p['anchor']['label']})")
    pts = [p for cr in res["clusters"].values() for sr in cr["seeds"].values() for p in sr["points"]]
    summary = {k: {"min": min(p[k] for p in pts), "mean": float(np.mean([p[k] for p in pts]))}
               for k in ("learning_x_oracle", "prior_x_oracle", "learning_x_anchor", "prior_x_anchor",
                         "oracle_x_anchor")} if pts else {}
    return {"misses": misses, "all_met": not misses, "points": len(pts), "summary": summary}


# ---------------------------------------------------------------- drift
def _drift_workers() -> list[WorkerSpec]:
    return pool("h100", DRIFT_WORKERS, "nvidia-h100", model="llama-3.1-70b", devices=8, max_batch=128,
                step_tokens=8192)


def _watch(pol: Any, wid: str, log: list[tuple[float, float, float]]) -> None:
    """Record the slowed worker's prediction error on each report, with the fit as it stood before the report."""
    orig = pol.observe

    def observe(w: Any, steps: Any, now: float, instance: str = "") -> Any:
        if w.worker_id == wid and steps and pol.learner is not None:
            lr = pol.learner
            fit = lr.fits.get(wid)
            cm = lr.models.get(wid)
            if fit is not None and cm is not None:
                y = np.array([s.seconds for s in steps])
                err = float(np.median(np.abs(predict(features(cm, steps), fit.theta) / y - 1.0)))
                log.append((now, err, speed(pol, wid, cm.eff)))
        return orig(w, steps, now, instance)

    pol.observe = observe


def _first_for_good(times: list[float], ok: list[bool], after: float) -> float | None:
    """The first time >= after from which every later entry is ok (None: never)."""
    t = None
    for ti, o in zip(times, ok, strict=True):
        if ti < after:
            continue
        if not o:
            t = None
        elif t is None:
            t = ti
    return t


def drift_run(learn: bool, data: str) -> dict[str, Any]:
    t0 = time.time()
    trace = load(Path(data) / TRACES["azure-conv"], limit=20000)
    cfg = SimConfig()
    cap = max(capacity(lambda _layout: _drift_workers(), trace, cfg, DRIFT_SLO).values())
    natural = len(trace) / max(trace.requests[-1].arrival - trace.requests[0].arrival, 1e-9)
    tr = trace.scaled(DRIFT_LOAD * cap / natural)
    start = tr.requests[0].arrival
    tr = Trace([r for r in tr.requests if r.arrival < start + DRIFT_SPAN_S], tr.block_tokens, tr.name)
    ws = _drift_workers()
    slow = ws[0].worker_id
    at = start + DRIFT_AT_S
    ws[0] = dataclasses.replace(ws[0], truth=Truth(slowdown=2.0, after_s=at))
    sc = SchedulerConfig()
    pol = policy_for("cost", ws, DRIFT_SLO, objective=sc.objective, admission_margin=sc.admission_margin, learn=learn)
    log: list[tuple[float, float, float]] = []
    _watch(pol, slow, log)
    s, res = simulate(ws, pol, tr, cfg, DRIFT_SLO)
    out: dict[str, Any] = {"learn": learn, "capacity_req_s": cap, "rate_req_s": DRIFT_LOAD * cap,
                           "requests": len(tr), "slowdown_at_s": DRIFT_AT_S, "goodput_tok_s": _row(s, tr, "", "")[
                               "goodput_tok_s"], "offered_slo_attainment": s["offered_slo_attainment"],
                           "rejected": s["rejected"]}
    # (a) prediction error of the slowed worker, per report
    if learn:
        times = [t - start for t, _, _ in log]
        ok = [e <= PRED_OK for _, e, _ in log]
        back = _first_for_good(times, ok, DRIFT_AT_S)
        pre = [e for t, e, _ in log if t - start < DRIFT_AT_S]
        out["prediction"] = {
            "error_before_median": float(np.median(pre)) if pre else math.nan,
            "back_within_s": None if back is None else back - DRIFT_AT_S,
            "first_within_s": next((t - DRIFT_AT_S for t, o in zip(times, ok, strict=True) if t >= DRIFT_AT_S and o),
                                   None),
            "speed_before": float(np.median([v for t, _, v in log if t - start < DRIFT_AT_S] or [math.nan])),
            "speed_end": log[-1][2] if log else math.nan,
            "degraded_ratio_end": pol.learner.degraded(slow) if pol.learner is not None else math.nan,
            "trace": [(round(t - start, 2), round(e, 4), round(v, 4)) for t, e, v in log
                      if DRIFT_AT_S - 5 <= t - start <= DRIFT_AT_S + 40]}
    else:  # the scheduler keeps pricing it at the prior: 2x too fast from T on
        out["prediction"] = {"error_before_median": 0.0, "back_within_s": None, "first_within_s": None,
                             "error_after": 0.5}
    # (b) its share of placements (prefill and decode), by arrival
    recs = res.records
    phases = {"before": (0.0, DRIFT_AT_S), "first 30 s": (DRIFT_AT_S, DRIFT_AT_S + 30.0),
              "after": (DRIFT_AT_S + 30.0, math.inf)}
    share = {}
    for name, (a, b) in phases.items():
        sel = [r for r in recs if a <= r.arrival - start < b]
        n = max(len(sel), 1)
        share[name] = {"prefill": sum(r.prefill_worker == slow for r in sel) / n,
                       "decode": sum(r.decode_worker == slow for r in sel) / n, "requests": len(sel)}
    out["share"] = share
    # (c) SLO attainment per 10 s window of arrivals (met / offered)
    arr = np.array([r.arrival - start for r in tr.requests])
    met = np.array([r.arrival - start for r in recs
                    if r.ttft <= DRIFT_SLO.ttft_s and (r.output_len <= 1 or r.tpot <= DRIFT_SLO.tpot_s)])
    edges = np.arange(0.0, DRIFT_SPAN_S + WINDOW_S / 2, WINDOW_S)
    offered_n = np.histogram(arr, edges)[0]
    met_n = np.histogram(met, edges)[0]
    att = [float(m / o) if o else 1.0 for m, o in zip(met_n, offered_n, strict=True)]
    base = float(np.mean([a for e, a in zip(edges[:-1], att, strict=True) if e + WINDOW_S <= DRIFT_AT_S]))
    ok = [a >= base - SLO_DIP for a in att]
    back = _first_for_good(list(edges[:-1]), ok, DRIFT_AT_S)
    out["slo"] = {"windows": [{"start_s": float(e), "offered": int(o), "attainment": a}
                              for e, o, a in zip(edges[:-1], offered_n, att, strict=True)],
                  "before": base, "worst_after": min(att[i] for i, e in enumerate(edges[:-1]) if e >= DRIFT_AT_S),
                  "after_60s": float(np.mean([a for e, a in zip(edges[:-1], att, strict=True)
                                              if e >= DRIFT_AT_S + SLO_WITHIN_S])),
                  "recovered_within_s": None if back is None else float(back - DRIFT_AT_S)}
    out["wall_s"] = time.time() - t0
    return out


def drift(args: argparse.Namespace, pool_: ProcessPoolExecutor) -> dict[str, Any]:
    futs = {learn: pool_.submit(drift_run, learn, args.data) for learn in (True, False)}
    runs = {"learning" if k else "no learning": f.result() for k, f in futs.items()}
    lr = runs["learning"]
    p, sh, slo = lr["prediction"], lr["share"], lr["slo"]
    misses = []
    if p["back_within_s"] is None or p["back_within_s"] > PRED_WITHIN_S:
        misses.append(f"predictions back within 15% after {p['back_within_s']} s (target <= {PRED_WITHIN_S:g} s)")
    if not sh["after"]["prefill"] < sh["before"]["prefill"]:
        misses.append(f"its prefill share did not fall ({sh['before']['prefill']:.2f} -> {sh['after']['prefill']:.2f})")
    if slo["recovered_within_s"] is None or slo["recovered_within_s"] > SLO_WITHIN_S:
        misses.append(f"SLO attainment back after {slo['recovered_within_s']} s (target <= {SLO_WITHIN_S:g} s)")
    return {"pool": f"{DRIFT_WORKERS}x 8xH100, Llama-3.1-70B, every worker both", "trace": "azure-conv",
            "slo": dataclasses.asdict(DRIFT_SLO), "load": DRIFT_LOAD, "span_s": DRIFT_SPAN_S,
            "slowdown": 2.0, "slowdown_at_s": DRIFT_AT_S, "window_s": WINDOW_S, "runs": runs,
            "verdict": {"misses": misses, "all_met": not misses}}


# ---------------------------------------------------------------- output
def _print(console: Console, results: dict[str, Any]) -> None:
    wp = results.get("wrong_priors")
    if wp:
        for c, cr in wp["clusters"].items():
            tb = Table(title=f"wrong priors, {c} / {cr['trace']}: {cr['cluster']}; SLO TTFT {cr['slo']['ttft_s']}s "
                             f"TPOT {cr['slo']['tpot_s']}s")
            for col in ("seed", "true/prior capacity", "load", "learning", "prior only", "oracle", "best anchor",
                        "learn/oracle", "prior/oracle", "learn/anchor", "prior/anchor", "speed err prior/learned (max)"):
                tb.add_column(col, justify="right")
            for s, sr in cr["seeds"].items():
                for p in sr["points"]:
                    tb.add_row(s, f"{sr['capacity_req_s']:.2f}/{sr['prior_capacity_req_s']:.2f}", f"{p['load']:g}x",
                               *(f"{p[k]['goodput_tok_s']:.0f}" for k in ("learning", "prior", "oracle", "anchor")),
                               *(f"{p[k]:.2f}" for k in ("learning_x_oracle", "prior_x_oracle", "learning_x_anchor",
                                                         "prior_x_anchor")),
                               f"{100 * max(p['prior_speed_error'].values()):.0f}%/"
                               f"{100 * max(p['learned_speed_error'].values()):.1f}%")
            console.print(tb)
        v = wp["verdict"]
        console.print("wrong priors: targets met everywhere" if v["all_met"]
                      else "wrong priors, targets missed:\n  " + "\n  ".join(v["misses"]))
    dr = results.get("drift")
    if dr:
        tb = Table(title=f"drift: {dr['pool']}, {dr['trace']} at {dr['load']:g}x capacity; one worker 2x slower "
                         f"from {dr['slowdown_at_s']:g} s")
        for col in ("run", "goodput tok/s", "pred. within 15% after", "share before/first 30s/after (prefill)",
                    "SLO before", "worst window after", "SLO from T+60s", "SLO recovered after"):
            tb.add_column(col, justify="right")
        for name, r in dr["runs"].items():
            sh, p, slo = r["share"], r["prediction"], r["slo"]
            tb.add_row(name, f"{r['goodput_tok_s']:.0f}",
                       "never" if p["back_within_s"] is None else f"{p['back_within_s']:.1f} s",
                       "/".join(f"{100 * sh[k]['prefill']:.0f}%" for k in ("before", "first 30 s", "after")),
                       f"{100 * slo['before']:.0f}%", f"{100 * slo['worst_after']:.0f}%",
                       f"{100 * slo['after_60s']:.0f}%",
                       "never" if slo["recovered_within_s"] is None else f"{slo['recovered_within_s']:.0f} s")
        console.print(tb)
        v = dr["verdict"]
        console.print("drift: targets met" if v["all_met"] else "drift, targets missed:\n  " + "\n  ".join(v["misses"]))


def markdown(results: dict[str, Any]) -> str:
    """The docs tables: wrong priors per cluster and load over the seeds (min and mean of each ratio; the worst
    seed's goodputs), and the drift runs."""
    lines = []
    wp = results.get("wrong_priors")
    if wp:
        n = len(wp["seeds"])
        lines += ["| cluster / trace | load | learning / oracle, min (mean) | prior only / oracle | learning / best "
                  "anchor | prior only / best anchor | worst seed: learning, prior, oracle, anchor tok/s |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for c, cr in wp["clusters"].items():
            for x in wp["loads"]:
                pts = [p for sr in cr["seeds"].values() for p in sr["points"] if p["load"] == x]
                if not pts:
                    continue

                def mm(k: str, pct: bool, pts: list[dict[str, Any]] = pts) -> str:
                    v = [p[k] for p in pts]
                    return (f"{100 * min(v):.0f}% ({100 * float(np.mean(v)):.0f}%)" if pct
                            else f"{min(v):.2f}x ({float(np.mean(v)):.2f}x)")
                w = min(pts, key=lambda p: p["learning_x_oracle"])
                lines.append(f"| {c} / {cr['trace']} | {x:g}x | {mm('learning_x_oracle', True)} | "
                             f"{mm('prior_x_oracle', True)} | {mm('learning_x_anchor', False)} | "
                             f"{mm('prior_x_anchor', False)} | seed {w['seed']}: " + ", ".join(
                                 f"{w[k]['goodput_tok_s']:.0f}" for k in ("learning", "prior", "oracle", "anchor"))
                             + " |")
        lines.append(f"\n({n} seeds per row.)")
    dr = results.get("drift")
    if dr:
        lines += ["", "| run | goodput tok/s | predictions within 15% after | slow worker's prefill share before / "
                  "first 30 s / after | SLO attainment before / worst 10 s / from T+60 s | recovered after |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, r in dr["runs"].items():
            sh, p, slo = r["share"], r["prediction"], r["slo"]
            lines.append(f"| {name} | {r['goodput_tok_s']:.0f} | "
                         + ("never (2x off)" if p["back_within_s"] is None else f"{p['back_within_s']:.1f} s") + " | "
                         + " / ".join(f"{100 * sh[k]['prefill']:.0f}%" for k in ("before", "first 30 s", "after"))
                         + f" | {100 * slo['before']:.0f}% / {100 * slo['worst_after']:.0f}% / "
                           f"{100 * slo['after_60s']:.0f}% | "
                         + ("never" if slo["recovered_within_s"] is None else f"{slo['recovered_within_s']:.0f} s")
                         + " |")
    return "\n".join(lines)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", nargs="*", type=int, default=list(range(1, 9)), help="draws of the true factors")
    ap.add_argument("--span", type=float, default=60.0,
                    help="virtual seconds of arrivals at 1x capacity (at least 300, at most --max-requests requests)")
    ap.add_argument("--max-requests", type=int, default=3000)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--data", default=str(DATA_DIR), help="folder of the traces (default: data/)")
    ap.add_argument("--only", nargs="*", default=None, choices=sorted(CLUSTERS), help="clusters (default: all)")
    ap.add_argument("--skip-drift", action="store_true")
    ap.add_argument("--skip-priors", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "learning.json"),
                    help="results file (a subset run: write it elsewhere, e.g. /tmp/learning.json)")
    ap.add_argument("--tables", action="store_true", help="print the tables of --out, run nothing")
    args = ap.parse_args()
    console = Console(width=180)
    if args.tables:
        results = json.loads(Path(args.out).read_text())
        _print(console, results)
        console.print(markdown(results), soft_wrap=True)
        return 0
    t0 = time.time()
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]), "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty_libs": _git("status", "--short", "--", "libs").splitlines(),  # others' work in the tree then
        "cost_defaults": {"objective": SchedulerConfig().objective,
                          "admission_margin": SchedulerConfig().admission_margin}}
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        if not args.skip_drift:
            results["drift"] = drift(args, ex)
            _print(console, {"drift": results["drift"]})
        if not args.skip_priors:
            results["wrong_priors"] = wrong_priors(args, console, ex)
    results["wall_s"] = time.time() - t0
    _print(console, results)
    console.print(markdown(results), soft_wrap=True)
    write_json(Path(args.out), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
