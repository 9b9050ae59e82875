"""Summaries of a simulation run: throughput, latency percentiles, goodput, utilization."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetmesh.costmodel.economics import fleet_usd_per_hour, usd_per_mtok
from hetmesh.sim.results import SimResult


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1


def _pct(xs: np.ndarray) -> dict[str, float]:
    if xs.size == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(xs.mean())}


def summarize(res: SimResult, slo: Slo | Mapping[str, Slo] = Slo(),
              prices: Mapping[str, float] | None = None) -> dict[str, Any]:
    """`slo`: one for every request, or one per model (the model's own SLOs). `prices`: $/device-hour
    overrides of the catalog's, for the fleet's $/hour and $ per million (good) output tokens."""
    recs = res.records
    dur = max(res.end - res.start, 1e-9)
    out = np.array([r.output_len for r in recs], dtype=float)
    ttft = np.array([r.ttft for r in recs])
    multi = [r for r in recs if r.output_len > 1]
    tpot = np.array([r.tpot for r in multi])
    slos = slo if isinstance(slo, Mapping) else {}
    one = slo if isinstance(slo, Slo) else Slo()
    names = np.array([r.model for r in recs])
    ttft_slo = np.full(len(recs), one.ttft_s)
    tpot_slo = np.full(len(recs), one.tpot_s)
    for m, s in slos.items():
        sel = names == m
        ttft_slo[sel], tpot_slo[sel] = s.ttft_s, s.tpot_s
    tpots = np.array([r.tpot for r in recs])
    ok = (ttft <= ttft_slo) & ((out <= 1) | (tpots <= tpot_slo)) if recs else np.zeros(0, dtype=bool)
    # steady state: requests finishing between the 10th and 90th percentile of finish times
    # (drops the ramp-up of a closed loop and the drain at the end)
    steady = float("nan")
    if len(recs) >= 50:
        fin = np.array([r.finish for r in recs])
        order = np.argsort(fin)
        lo, hi = order[len(order) // 10], order[(len(order) * 9) // 10]
        t0, t1 = fin[lo], fin[hi]
        sel = (fin > t0) & (fin <= t1)
        steady = float(out[sel].sum() / (t1 - t0)) if t1 > t0 else float("nan")
    prompt = sum(r.input_len for r in recs)
    pools: dict[str, dict[str, float]] = defaultdict(lambda: {"workers": 0, "busy_s": 0.0, "prefill_tokens": 0,
                                                             "decode_tokens": 0})
    for w in res.workers:
        p = pools[w.pool]
        p["workers"] += 1
        p["busy_s"] += w.busy_s
        p["prefill_tokens"] += w.prefill_tokens
        p["decode_tokens"] += w.decode_tokens
    pool_out = {k: {"accelerator": next(w.accelerator for w in res.workers if w.pool == k),
                    "workers": int(v["workers"]), "utilization": v["busy_s"] / (v["workers"] * dur),
                    "prefill_tokens": int(v["prefill_tokens"]), "decode_tokens": int(v["decode_tokens"])}
                for k, v in pools.items()}
    modes: dict[str, int] = defaultdict(int)
    for r in recs:
        modes[r.mode] += 1
    usd_h = fleet_usd_per_hour(((w.accelerator, w.devices) for w in res.workers), prices)
    goodput = float(out[ok].sum() / dur) if recs else 0.0
    per_model: dict[str, dict[str, float]] = {}
    for m in sorted(set(names.tolist())) if len(set(names.tolist())) > 1 else []:
        sel = names == m
        per_model[m] = {"requests": int(sel.sum()), "output_tok_s": float(out[sel].sum() / dur),
                        "goodput_tok_s": float(out[sel & ok].sum() / dur), "slo_attainment": float(ok[sel].mean()),
                        "offered_slo_attainment": float(ok[sel].sum() / (sel.sum() + res.rejected_models.get(m, 0)))}
    tenants = tenant_summary(res, recs, ok, out, dur)
    return {
        "policy": res.policy,
        "requests": len(recs),
        "rejected": res.rejected,
        "duration_s": dur,
        "output_tok_s": float(out.sum() / dur),
        "output_tok_s_steady": steady,
        "requests_per_s": len(recs) / dur,
        "ttft_s": _pct(ttft),
        "tpot_s": _pct(tpot),
        "slo": {m: {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s} for m, s in slos.items()} if slos
        else {"ttft_s": one.ttft_s, "tpot_s": one.tpot_s},
        "slo_attainment": float(ok.mean()) if recs else 0.0,
        # of every request offered: the rejected (and admission-refused) ones count as misses
        "refused": res.refused,
        "retried": res.retried,
        "policy_calls": res.policy_calls,
        "held": res.held,
        "offered_slo_attainment": float(ok.sum() / (len(recs) + res.rejected)) if recs or res.rejected else 0.0,
        "goodput_tok_s": goodput,
        "usd_per_hour": usd_h,
        "usd_per_mtok": usd_per_mtok(usd_h, float(out.sum() / dur)),
        "usd_per_good_mtok": usd_per_mtok(usd_h, goodput),
        "goodput_req_s": float(ok.sum() / dur),
        "kv_transfer_gb": res.kv_transfer_bytes / 1e9,
        "prefix_hit_rate": sum(r.cached_tokens for r in recs) / prompt if prompt else 0.0,
        "modes": dict(modes),
        "pools": pool_out,
        **({"models": per_model} if per_model else {}),
        **({"tenants": tenants} if tenants else {}),
    }


def tenant_summary(res: SimResult, recs: list, ok: np.ndarray, out: np.ndarray, dur: float) -> dict[str, dict]:
    """Per tenant (when any request names one, or flow control ran): requests served, goodput, SLO attainment of
    the served and of all offered (refused ones count as misses), refusals, and flow control's own counts."""
    names = np.array([r.tenant for r in recs])
    known = set(names.tolist()) | set(res.rejected_tenants) | set(res.flow)
    if not res.flow and known <= {"", "default"}:  # no request named a tenant
        return {}
    per: dict[str, dict] = {}
    for t in sorted(known):
        sel = names == t
        n, rej = int(sel.sum()), res.rejected_tenants.get(t, 0)
        if not n and not rej:
            continue
        st = res.flow.get(t)
        per[t] = {"requests": n, "rejected": rej, "output_tok_s": float(out[sel].sum() / dur),
                  "goodput_tok_s": float(out[sel & ok].sum() / dur),
                  "slo_attainment": float(ok[sel].mean()) if n else 0.0,
                  "offered_slo_attainment": float(ok[sel].sum() / (n + rej)),
                  **({"held": st.held, "held_s": st.held_s, "flow_refused": st.refused} if st is not None else {})}
    return per
