"""The planner benchmark's heterogeneity part (run through benchmarks/planner.py --parts heterogeneity).

Does a mix of chip kinds meet the SLOs for less than the cheapest single kind? First, why or why
not, from the cost model alone: each kind's $ per million prompt tokens prefilled and per million
output tokens decoded within the SLOs (steady state, the best layout per kind), and the saving that
specialising each role on its cheapest kind could reach at most. Then the capacity plans, simulated:
the catalog as priced, the MI300X price swept, an NVIDIA-only catalog, and a long-context mix.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hetmesh.costmodel import accelerators
from hetmesh.costmodel.economics import device_usd_per_hour
from hetmesh.planner import ModelDemand, ServerGroup, demand_from_trace, length_buckets
from hetmesh.planner.buy import cheapest, reprice, restrict
from hetmesh.planner.measure import calibrate
from hetmesh.planner.plan import options
from hetmesh.planner.solve import Option, solve
from hetmesh.protocol import Role
from hetmesh.sim.traces import DATA_DIR, Trace, TraceRequest, load_azure, load_mooncake

PURCHASE = ["nvidia-a100-80g", "nvidia-h100", "nvidia-h200", "nvidia-b200", "nvidia-rubin-cpx", "nvidia-rubin-vr200",
            "amd-mi300x", "amd-mi308x"]
NVIDIA = [k for k in PURCHASE if k.startswith("nvidia-")]
SWEPT = "amd-mi300x"  # the kind that is the best value at the catalog price; its price is swept
SWEEP_USD = (4.5,)  # $/device-h simulated besides the catalog price (the steady state sweeps CLOSED_FORM_USD)
CLOSED_FORM_USD = tuple(x / 2 for x in range(4, 17))  # $2 to $8 per device-hour, steady state only
ATTAINMENT = 0.9  # default share of requests within both SLOs that `meets the SLOs` asks for
BUCKETS = (1, 2, 3, 4)  # prompt x output length quantile buckets per model, each way, for the bucketed bound
PRUNE = 2.0  # a single kind this many times dearer than the best one in the steady state is not simulated


def _merge(parts: Sequence[tuple[Trace, str]], scale: float, name: str) -> Trace:
    reqs = [TraceRequest(r.arrival, r.input_len, r.output_len, r.hash_ids, model) for t, model in parts
            for r in t.requests]
    reqs.sort(key=lambda r: r.arrival)
    return Trace(reqs, parts[0][0].block_tokens, name).scaled(scale)


def mixed(n: int, scale: float) -> tuple[Trace, list[ModelDemand]]:
    """Azure conversation (Llama-3.1-70B) + Azure code (Qwen3-32B), `n` requests each, `scale`x faster."""
    conv = load_azure(DATA_DIR / "azure2023_AzureLLMInferenceTrace_conv.csv", limit=n)
    code = load_azure(DATA_DIR / "azure2023_AzureLLMInferenceTrace_code.csv", limit=n)
    tr = _merge([(conv, "chat"), (code, "code")], scale, "azure-conv+code")
    return tr, [demand_from_trace(tr, name="chat", spec="llama-3.1-70b", ttft_slo_s=2.0, tpot_slo_s=0.1),
                demand_from_trace(tr, name="code", spec="qwen3-32b", ttft_slo_s=4.0, tpot_slo_s=0.05)]


def long_mixed(n: int, scale: float) -> tuple[Trace, list[ModelDemand]]:
    """Azure conversation (Llama-3.1-70B, `n` requests) + the Mooncake trace's long prompts over the
    same span (Qwen3-32B with the code model's SLOs), `scale`x faster. The Azure code trace is not
    long-context (mean prompt 2k tokens, max 7.4k); Mooncake's are (mean ~12k, prefix reuse)."""
    conv = load_azure(DATA_DIR / "azure2023_AzureLLMInferenceTrace_conv.csv", limit=n)
    span = conv.requests[-1].arrival
    moon = load_mooncake(DATA_DIR / "mooncake_synthetic_trace.jsonl")
    moon = Trace([r for r in moon.requests if r.arrival <= span], moon.block_tokens, moon.name)
    tr = _merge([(conv, "chat"), (moon, "long")], scale, "azure-conv+mooncake")
    return tr, [demand_from_trace(tr, name="chat", spec="llama-3.1-70b", ttft_slo_s=2.0, tpot_slo_s=0.1),
                demand_from_trace(tr, name="long", spec="qwen3-32b", ttft_slo_s=4.0, tpot_slo_s=0.05)]


def _per_mtok(usd_per_request: float, tokens: float) -> float | None:
    return round(usd_per_request / tokens * 1e6, 3) if math.isfinite(usd_per_request) else None


def value(kinds: Sequence[str], demands: Sequence[ModelDemand], purchase: Sequence[str],
          prices: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Per kind and model, from the steady-state capacities (capacity.py, best layout per role):
    $ per million prompt tokens prefilled, per million output tokens decoded, and per million output
    tokens served aggregated (prompt included). Then the $ per second the demand costs on the best
    single kind of `purchase` (each model aggregated or P/D on that kind, whichever is cheaper) and
    with every role on its cheapest kind: the most a mix could save, before whole servers and bursts."""
    groups = [ServerGroup(name=k, accelerator=k, max_batch=128) for k in kinds]
    opts = options(groups, demands, prices)
    per_req: dict[str, dict[str, dict[str, float]]] = {}  # kind -> model -> role -> $ per request
    table: list[dict[str, Any]] = []
    for gi, k in enumerate(kinds):
        per_req[k] = {}
        for d in demands:
            best = {r: max((o.capacity for o in opts if o.group == gi and o.model == d.name and o.role == r),
                           default=0.0) for r in (Role.PREFILL, Role.DECODE, Role.BOTH)}
            usd_s = device_usd_per_hour(k, prices) * groups[gi].devices / 3600
            cost = {str(r): usd_s / c if c > 0 else float("inf") for r, c in best.items()}
            per_req[k][d.name] = cost
            table.append({"kind": k, "model": d.name, "usd_per_gpu_h": device_usd_per_hour(k, prices),
                          "prefill_usd_per_mtok_in": _per_mtok(cost["prefill"], d.input_mean),
                          "decode_usd_per_mtok_out": _per_mtok(cost["decode"], d.output_mean),
                          "both_usd_per_mtok_out": _per_mtok(cost["both"], d.output_mean)})

    def single(k: str, d: ModelDemand) -> float:
        c = per_req[k][d.name]
        return min(c["both"], c["prefill"] + c["decode"])

    singles = {k: sum(d.rate * single(k, d) for d in demands) for k in purchase}
    best_single = min(singles, key=lambda k: singles[k])
    cheapest_role = {d.name: {r: min(purchase, key=lambda k, r=r, d=d: per_req[k][d.name][r])
                              for r in ("prefill", "decode", "both")} for d in demands}
    mix = 0.0
    for d in demands:
        c = cheapest_role[d.name]
        mix += d.rate * min(per_req[c["both"]][d.name]["both"],
                            per_req[c["prefill"]][d.name]["prefill"] + per_req[c["decode"]][d.name]["decode"])
    one_kind_both_roles = {m: c["prefill"] == c["decode"] for m, c in cheapest_role.items()}
    return {"table": table, "cheapest_per_role": cheapest_role, "one_kind_cheapest_for_both_roles": one_kind_both_roles,
            "single_usd_h": {k: v * 3600 for k, v in singles.items()},
            "best_single_kind": best_single, "best_single_usd_h": singles[best_single] * 3600,
            "specialised_usd_h": mix * 3600, "saving_bound": 1 - mix / singles[best_single]}


def measured_bound(kinds: Sequence[ServerGroup], opts: Sequence[Option], demands: Sequence[ModelDemand],
                   names: Sequence[str]) -> dict[str, Any]:
    """The most a mix of the kinds `names` can save on the measured capacities (`calibrate`: pools
    simulated on the trace, its bursts included) with servers bought in fractions (the integer program's
    linear relaxation): whole servers and the mix's own simulation can only cost more. The steady-state
    bound (`value`) leaves out the bursts that the measurement prices."""
    def usd(ns: Sequence[str]) -> float | None:
        ks, os_ = restrict(kinds, opts, ns)
        s = solve(ks, demands, os_, minimize_cost=True, relaxed=True) if os_ else None
        return None if s is None else round(s.usd_per_hour, 1)

    singles = {k: v for k in names if (v := usd([k])) is not None}
    mix = usd(names)
    best = min(singles, key=lambda k: singles[k]) if singles else None
    return {"mixed_usd_h": mix, "singles_usd_h": singles, "best_single_kind": best,
            "saving_bound": round(1 - mix / singles[best], 3) if mix is not None and best else None}


def _compare(kinds: list[ServerGroup], opts: list, demands: Sequence[ModelDemand], tr: Trace, names: Sequence[str],
             singles: dict[str, Any], prices: Mapping[str, float] | None = None,
             attainment: float = ATTAINMENT) -> dict[str, Any]:
    """The cheapest purchase over the kinds `names` against the cheapest single kind of them. Single
    kinds are simulated once each (`singles` caches them across calls, at catalog prices; a single
    kind buys the fewest servers whatever its price), and only where the steady state puts that
    kind within PRUNE x the steady-state best single of `names`: the others cannot be cheapest."""
    steady = value(names, demands, names, prices)["single_usd_h"]
    floor = min(steady.values())
    pruned = {k: round(v / floor, 2) for k, v in steady.items() if v > PRUNE * floor}
    ks, os_ = restrict(kinds, reprice(kinds, opts, prices), names)
    m = cheapest(ks, demands, trace=tr, attainment=attainment, prices=prices, opts=os_,
                 alone=[k for k in names if k not in pruned])
    for k in names:
        if k not in singles and k not in pruned:
            k1, o1 = restrict(kinds, opts, [k])
            q = cheapest(k1, demands, trace=tr, attainment=attainment, opts=o1) if o1 else None
            singles[k] = None if q is None or not q.meets else {"servers": q.servers, "slo_attainment": q.slo_attainment,
                                                                "model_attainment": q.model_attainment}
    priced = {k: sum(n * device_usd_per_hour(k, prices) * kinds[[g.name for g in kinds].index(k)].devices
                     for n in v["servers"].values())
              for k, v in singles.items() if v and k in names and k not in pruned}
    best = min(priced, key=lambda k: priced[k]) if priced else None
    saving = 1 - m.usd_per_hour / priced[best] if m is not None and m.meets and best else None
    return {"measured_bound": measured_bound(ks, os_, demands, names),
            "mixed": None if m is None else {"servers": m.servers, "usd_per_hour": m.usd_per_hour,
                                             "slo_attainment": m.slo_attainment,
                                             "model_attainment": m.model_attainment, "meets": m.meets},
            "singles": {k: singles.get(k) for k in names if k not in pruned}, "singles_usd_per_hour": priced,
            "singles_pruned_steady_state_x": pruned, "cheapest_single": best, "saving": saving,
            "saves_30pct": bool(saving is not None and saving >= 0.30)}


def _bound_sweep(demands: Sequence[ModelDemand]) -> list[dict[str, Any]]:
    """The steady-state saving bound (`value`) as the swept kind's price moves."""
    out = []
    for usd in CLOSED_FORM_USD:
        v = value(PURCHASE, demands, PURCHASE, {SWEPT: usd})
        out.append({"usd_per_gpu_h": usd, "best_single_kind": v["best_single_kind"],
                    "saving_bound": round(v["saving_bound"], 3)})
    return out


def _catalog() -> list[ServerGroup]:
    """Every kind one may buy, up to 48 servers each."""
    return [ServerGroup(name=k, accelerator=k, count=48, max_batch=128) for k in PURCHASE]


def _log(t0: float, what: str) -> None:
    print(f"  heterogeneity: {what} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


def part_heterogeneity(n: int, scale: float, long_n: int, attainment: float = ATTAINMENT) -> dict[str, Any]:
    t0 = time.perf_counter()
    tr, demands = mixed(n, scale)
    kinds = _catalog()
    opts = calibrate(kinds, demands, options(kinds, demands), tr, attainment)  # measured once, for every catalog
    _log(t0, "options measured")
    cache: dict[str, Any] = {}
    base = _compare(kinds, opts, demands, tr, PURCHASE, cache, attainment=attainment)
    _log(t0, "catalog as priced")
    sweep = []
    for usd in SWEEP_USD:
        got = _compare(kinds, opts, demands, tr, PURCHASE, cache, {SWEPT: usd}, attainment=attainment)
        sweep.append({"usd_per_gpu_h": usd, "mixed_usd_h": got["mixed"] and got["mixed"]["usd_per_hour"],
                      "mixed_servers": got["mixed"] and got["mixed"]["servers"],
                      "cheapest_single": got["cheapest_single"],
                      "single_usd_h": got["cheapest_single"] and got["singles_usd_per_hour"][got["cheapest_single"]],
                      "saving": got["saving"]})
    _log(t0, "price sweep")
    nvidia = _compare(kinds, opts, demands, tr, NVIDIA, cache, attainment=attainment)
    _log(t0, "nvidia-only")
    return {"requests": len(tr.requests), "rate_scale": scale, "attainment_target": attainment,
            "demands": [(d.name, round(d.rate, 2), round(d.input_mean), round(d.output_mean)) for d in demands],
            **base, "swept_kind": SWEPT, "price_sweep": sweep,
            "saves_30pct_at_usd": next((s["usd_per_gpu_h"] for s in sweep if (s["saving"] or 0) >= 0.30), None),
            "nvidia_only": nvidia, "long_context": part_long_context(long_n, scale, attainment)}


def part_long_context(long_n: int, scale: float, attainment: float = ATTAINMENT) -> dict[str, Any]:
    """The long-context mix alone (run through --parts long_context, e.g. at another --scale: whole
    servers cost a small fleet more of its saving than a large one)."""
    t0 = time.perf_counter()
    kinds = _catalog()
    ltr, ldem = long_mixed(long_n, scale)
    lopts = calibrate(kinds, ldem, options(kinds, ldem), ltr, attainment)
    _log(t0, "long-context options measured")
    lcache: dict[str, Any] = {}
    longc = _compare(kinds, lopts, ldem, ltr, PURCHASE, lcache, attainment=attainment)
    _log(t0, "long-context")
    longc_nv = _compare(kinds, lopts, ldem, ltr, NVIDIA, lcache, attainment=attainment)
    _log(t0, "long-context nvidia-only")
    return {"requests": len(ltr.requests), "rate_scale": scale,
            "demands": [(d.name, round(d.rate, 2), round(d.input_mean), round(d.output_mean),
                         round(d.prefix_hit, 2)) for d in ldem],
            **longc, "nvidia_only": longc_nv}


def part_bound(n: int, scale: float, long_n: int, attainment: float = ATTAINMENT) -> dict[str, Any]:
    """`measured_bound` on both mixes (minutes: the capacities measured, no purchase simulated): the
    catalog as priced, the swept kind's prices, NVIDIA only."""
    kinds = _catalog()
    out: dict[str, Any] = {"attainment_target": attainment}
    for key, (tr, demands) in (("mixed", mixed(n, scale)), ("long_context", long_mixed(long_n, scale))):
        opts = calibrate(kinds, demands, options(kinds, demands), tr, attainment)
        out[key] = {"catalog": measured_bound(kinds, opts, demands, PURCHASE),
                    "price_sweep": {str(usd): measured_bound(kinds, reprice(kinds, opts, {SWEPT: usd}), demands,
                                                             PURCHASE) for usd in SWEEP_USD},
                    "nvidia_only": measured_bound(kinds, opts, demands, NVIDIA)}
    return out


def part_value(n: int, scale: float, long_n: int) -> dict[str, Any]:
    """The steady-state economics of both mixes (seconds): per-kind $/Mtok per role, the most a mix
    could save, and how that bound moves with the swept kind's price."""
    catalog = [k for k in accelerators() if not k.startswith("tenstorrent")]  # 24-32 GB cards hold neither model
    out: dict[str, Any] = {"swept_kind": SWEPT}
    for key, (tr, demands) in (("mixed", mixed(n, scale)), ("long_context", long_mixed(long_n, scale))):
        out[key] = {"trace": tr.name, "requests": len(tr.requests),
                    "demands": [(d.name, round(d.rate, 2), round(d.input_mean), round(d.output_mean),
                                 round(d.prefix_hit, 2)) for d in demands],
                    "catalog": value(catalog, demands, PURCHASE),
                    "nvidia_only": {k: v for k, v in value(NVIDIA, demands, NVIDIA).items() if k != "table"},
                    "price_sweep": _bound_sweep(demands),
                    "length_buckets": [_bucketed(tr, demands, b) for b in BUCKETS]}
    return out


def _bucketed(tr: Trace, demands: Sequence[ModelDemand], n: int) -> dict[str, Any]:
    v = value(PURCHASE, [b for d in demands for b in length_buckets(tr, d, n)], PURCHASE)
    return {"buckets_per_model": n * n, "best_single_kind": v["best_single_kind"],
            "best_single_usd_h": round(v["best_single_usd_h"], 1), "specialised_usd_h": round(v["specialised_usd_h"], 1),
            "saving_bound": round(v["saving_bound"], 3)}
