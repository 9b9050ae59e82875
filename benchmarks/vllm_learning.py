"""The cost model against a real engine: vLLM's CPU build on the tiny local model, the online fit fed by the
engine's own step log, per-request TTFT and TPOT predicted against observed, before and after learning.

1. One vLLM engine (hetmesh.engines.vllm_engine) starts; a short grid of steps (hetmesh calibrate's, not the
   workload below) gives a reference calibration; the prior is that calibration made 3x off (every step
   predicted 3x too slow, or --prior-scale), the situation of a catalog prior on a new kind of chip.
2. A mixed workload runs: prompts 32-2,048 tokens and outputs 16-256 (log-uniform), in waves of 1-8
   concurrent requests. Every --report-s the engine's step log is drained into hetmesh.costmodel.learn.Learner
   (as a worker's heartbeats would be) and the learned factors are snapshotted.
3. Each request's TTFT and TPOT are predicted from the steps it waited through (the engine's steps between its
   submission and its first token, and between its first and last), each step priced by the cost model, and
   for TTFT the first-token gap learned as the worker learns it (the median, over the requests reported so
   far, of each one's time to first token outside the engine's steps: hand-off, input and output work): with
   the prior ("before") and with the factors learned by the time the request was submitted ("after", over the
   second half of the requests). "Requests needed": the fewest requests after which the learned factors meet
   the targets (p50 |error| <= 10%, p90 <= 25%, TTFT and TPOT) on the second half.

Writes --out (results/vllm_learning.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# The cost model's label of this worker (vLLM runs on the CPU): a chip of low peak, so that this CPU's factors
# (and a prior 3x off them) stay within the online fit's range of efficiencies.
ACCEL = "tenstorrent-wormhole-n300"
MODEL = "tiny"


@dataclass
class Req:
    prompt: int
    output: int
    submit: float = 0.0
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0
    snapshot: int = 0  # index of the learned factors current at submission
    steps_ttft: list[int] = field(default_factory=list)
    steps_tpot: list[int] = field(default_factory=list)


def workload(n: int, seed: int) -> list[list[Req]]:
    """Waves of 1-8 concurrent requests; prompts 32-2,048 and outputs 16-256 tokens, log-uniform."""
    rng = random.Random(seed)

    def lu(lo: int, hi: int) -> int:
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    waves, left = [], n
    while left > 0:
        c = min(left, rng.randint(1, 8))
        waves.append([Req(lu(32, 2048), lu(16, 256)) for _ in range(c)])
        left -= c
    return waves


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.abs(xs), q)) if xs else math.nan


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from loadgen import cpu_ticks, steal_fraction

    from hetmesh.cli.calibrate import Runner, grid, representative
    from hetmesh.costmodel import CostModel, accelerator, model_spec
    from hetmesh.costmodel.calibrate import Sample, calibrate
    from hetmesh.costmodel.efficiency import Efficiency
    from hetmesh.costmodel.learn import Learner, StepLog, WorkerKey, features, predict, theta_of
    from hetmesh.engines.vllm_engine import VllmConfig, VllmEngine
    from hetmesh.engines.vllm_tiny import build

    d = Path(tempfile.mkdtemp(prefix="hetmesh-vllm-learning-"))
    model = build(d / "tiny-llama-cpu", max_positions=4096)
    engine = VllmEngine(VllmConfig(model_dir=str(model), model_name=MODEL, max_model_len=2560, dtype="float32",
                                   max_batch=8, kv_connector="", kv_cache_gib=2))
    t_start = time.perf_counter()
    await engine.start()

    # Every step the engine reports, with the time it was recorded (for each request's waits).
    stamped: list[tuple[float, Any]] = []

    class Stamped(StepLog):
        def add(self, sample: Any) -> None:
            stamped.append((time.perf_counter(), sample))
            super().add(sample)

    engine._stats.log = Stamped()
    spec = model_spec(str(model))
    chip = accelerator(ACCEL)
    try:
        runner = Runner(engine, json.loads((model / "config.json").read_text())["vocab_size"])
        await runner.shape(grid("small", 2048)[0])  # warm-up
        ref_steps = []
        for s in grid("small", 2048):
            rep = representative(await runner.shape(s))
            if rep is not None:
                ref_steps.append(rep)
        ref = calibrate(CostModel(chip, spec), [Sample.of_step(x) for x in ref_steps], fit_per_seq=True)
        k = args.prior_scale
        prior = Efficiency(compute=ref.compute / k, memory=min(1.5, ref.memory / k), overhead_s=ref.overhead_s * k,
                           per_seq_s=ref.per_seq_s * k)
        cm = CostModel(chip, spec, efficiency=prior)
        learner = Learner()
        key = WorkerKey(ACCEL, MODEL, 1, "tp")
        snapshots = [theta_of(prior)]  # factors after each report
        gap_snaps = [0.0]  # the learned first-token gap after each report (the prior knows none)
        gaps: list[float] = []  # the gaps measured since the last report, as a worker's heartbeat carries them
        done_at = [0]  # requests finished at each snapshot
        stamped.clear()
        engine.step_log()
        t0 = time.perf_counter()
        finished = 0

        async def report_loop() -> None:
            while True:
                await asyncio.sleep(args.report_s)
                steps = engine.step_log()
                if steps:
                    learner.observe("cpu-0", key, cm, steps, time.perf_counter() - t0)
                    learner.observe_gaps("cpu-0", gaps)
                    gaps.clear()
                    snapshots.append(learner.fits["cpu-0"].theta.copy())
                    gap_snaps.append(learner.first_token_gap("cpu-0"))
                    done_at.append(finished)

        async def one(r: Req) -> None:
            nonlocal finished
            req = runner.request(r.prompt, r.output)
            r.snapshot = len(snapshots) - 1
            r.submit = time.perf_counter()
            busy = engine.stats().busy_s
            await engine.submit(req)
            async for out in engine.stream(req.request_id):
                if out.token_ids and not r.first:
                    r.first = time.perf_counter()
                    gaps.append(max(r.first - r.submit - (engine.stats().busy_s - busy), 0.0))  # as the worker
                r.tokens += len(out.token_ids)
                r.last = time.perf_counter()
            finished += 1

        load0, ticks0 = os.getloadavg()[0], cpu_ticks()
        reporter = asyncio.create_task(report_loop())
        reqs: list[Req] = []
        for i, wave in enumerate(workload(args.requests, args.seed)):
            await asyncio.gather(*(one(r) for r in wave))
            reqs += wave
            print(f"wave {i}: {len(reqs)}/{args.requests} requests, {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        await asyncio.sleep(args.report_s * 1.5)
        reporter.cancel()
        wall = time.perf_counter() - t0
        steal = steal_fraction(ticks0, cpu_ticks())
        load1 = os.getloadavg()[0]
    finally:
        await engine.close()

    # Each request's steps: recorded after its submission up to its first token, then up to its last.
    ts = np.array([t for t, _ in stamped])
    samples = [s for _, s in stamped]
    feats = features(cm, samples)
    secs = np.array([x.seconds for x in samples])
    for r in reqs:
        a, b, c = np.searchsorted(ts, [r.submit, r.first, r.last + 1e-3])
        r.steps_ttft = list(range(a, b))
        r.steps_tpot = list(range(b, c))

    # Predictions need the matrix at each theta once: cache by snapshot index.
    cache: dict[int, np.ndarray] = {}

    def predict_at(i: int) -> np.ndarray:
        if i not in cache:
            cache[i] = predict(feats, snapshots[i])
        return cache[i]

    def errs_at(idx_of: Any, rs: list[Req]) -> dict[str, list[float]]:
        ttft, tpot = [], []
        for r in rs:
            p = predict_at(idx_of(r))
            if r.steps_ttft and r.first > r.submit:
                gap = gap_snaps[min(idx_of(r), len(gap_snaps) - 1)]
                ttft.append((float(p[r.steps_ttft].sum()) + gap) / (r.first - r.submit) - 1.0)
            if r.tokens > 1 and r.steps_tpot and r.last > r.first:
                tpot.append(float(p[r.steps_tpot].sum()) / (r.last - r.first) - 1.0)
        return {"ttft": ttft, "tpot": tpot}

    def summary(e: dict[str, list[float]]) -> dict[str, float]:
        out = {f"{m}_p{q}_abs_err": pct(e[m], q) for m in ("ttft", "tpot") for q in (50, 90)}
        out.update({f"{m}_median_signed_err": float(np.median(e[m])) if e[m] else math.nan for m in ("ttft", "tpot")})
        return out

    def meets(s: dict[str, float]) -> bool:
        return all(s[f"{m}_p50_abs_err"] <= 0.10 and s[f"{m}_p90_abs_err"] <= 0.25 for m in ("ttft", "tpot"))

    half = reqs[len(reqs) // 2:]
    before_all = summary(errs_at(lambda r: 0, reqs))
    before_half = summary(errs_at(lambda r: 0, half))
    after = summary(errs_at(lambda r: r.snapshot, half))
    final = summary(errs_at(lambda r: len(snapshots) - 1, half))
    needed = None
    for i in range(len(snapshots)):
        if meets(summary(errs_at(lambda r, i=i: i, half))):
            needed = done_at[i]
            break
    # The model's own floor on this run: least squares over every step of the workload (not online).
    ls = calibrate(CostModel(chip, spec), [Sample.of_step(x) for x in samples], fit_per_seq=True)
    snapshots.append(theta_of(ls))
    floor = summary(errs_at(lambda r: len(snapshots) - 1, half))
    snapshots.pop()
    cache.pop(len(snapshots), None)
    last = len(snapshots) - 1
    rows = [{"prompt": r.prompt, "output": r.output, "ttft_s": r.first - r.submit,
             "tpot_s": (r.last - r.first) / max(r.tokens - 1, 1),
             "ttft_pred_s": float(predict_at(last)[r.steps_ttft].sum()) + gap_snaps[last],
             "tpot_pred_s": float(predict_at(last)[r.steps_tpot].sum()) / max(r.tokens - 1, 1),
             # the engine's own measured seconds of those steps: where far below the client's, the time went
             # outside the engine's steps (the host's other load, the client's event loop)
             "ttft_steps_s": float(secs[r.steps_ttft].sum()),
             "tpot_steps_s": float(secs[r.steps_tpot].sum()) / max(r.tokens - 1, 1)} for r in reqs]
    fit = learner.fits.get("cpu-0")
    out = {
        "benchmark": "vllm_learning", "engine": "vllm (CPU build)", "model": "tiny random-weight Llama (hidden 256, 2 layers)",
        "host_cpus": os.cpu_count(), "host_load_1m_start_end": [load0, load1], "host_cpu_steal": steal, "requests": len(reqs), "waves": len(workload(args.requests, args.seed)),
        "workload_wall_s": wall, "total_wall_s": time.perf_counter() - t_start, "steps": len(samples),
        "prior_scale": args.prior_scale, "reference_calibration": vars_of(ref), "prior": vars_of(prior),
        "learned": vars_of(fit.efficiency) if fit else None, "fitted_steps": fit.samples if fit else 0,
        "dropped_steps": fit.dropped if fit else 0, "first_token_gap_s": gap_snaps[-1],
        "before_learning_all_requests": before_all, "before_learning_second_half": before_half,
        "after_learning_online_second_half": after, "final_fit_second_half": final,
        "least_squares_all_steps": vars_of(ls), "least_squares_floor_second_half": floor,
        "requests_needed": needed, "targets": {"p50": 0.10, "p90": 0.25, "requests_needed": 200},
        "meets_targets_online": meets(after),
        "note": "predicted = the cost model's price of the engine steps each request waited through (its TTFT: "
                "steps from submission to first token, plus the learned first-token gap: the median time to first "
                "token outside the engine's steps over the requests reported before; TPOT: from first to last "
                "token over tokens - 1); observed = "
                "wall time at the client of the engine (in process). 'after' uses the factors learned before "
                "each request was submitted. least_squares_floor: the cost model fitted offline to every step of "
                "this run, the best its form allows here.",
        "per_request_final_fit": rows,
    }
    return out


def vars_of(e: Any) -> dict[str, float]:
    return {k: float(getattr(e, k)) for k in ("compute", "memory", "overhead_s", "per_seq_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prior-scale", type=float, default=3.0, help="the prior predicts every step this many "
                    "times too slow")
    ap.add_argument("--report-s", type=float, default=0.5, help="seconds between step reports (heartbeats)")
    ap.add_argument("--out", default="results/vllm_learning.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    out = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for k in ("before_learning_second_half", "after_learning_online_second_half", "final_fit_second_half",
              "least_squares_floor_second_half"):
        s = out[k]
        print(f"{k}: TTFT p50 {s['ttft_p50_abs_err'] * 100:.1f}% p90 {s['ttft_p90_abs_err'] * 100:.1f}% | "
              f"TPOT p50 {s['tpot_p50_abs_err'] * 100:.1f}% p90 {s['tpot_p90_abs_err'] * 100:.1f}%")
    print(f"requests needed: {out['requests_needed']}; learned {out['learned']}; -> {args.out}")


if __name__ == "__main__":
    main()
