"""Measured step times of a Llama-3.1-8B-shaped model on one GPU vs the cost model's prior for it.

The prior: hetmesh.costmodel's `CostModel` for "llama-3.1-8b" on one "nvidia-h100" with the shipped efficiency
factors, `prefill_time(tokens)` and `decode_step_time(batch, batch * context)`. The measurement: a plain-torch
Llama forward (fused QKV and gate-up GEMMs, RMSNorm, RoPE, SDPA with grouped KV heads, logits of the last
position of each sequence, greedy argmax) with random bf16 weights, nothing downloaded:

- prefill of one prompt of 512, 2048, 8192 tokens (batch 1, no cache);
- one decode step of 1, 8, 32, 64, 128 sequences, each attending to a preallocated KV cache of 1024 tokens
  (its own new token included), eager and replayed from a CUDA graph (as serving engines run decode).

Times are CUDA-event medians after warm-ups. Two modes, since the GPU host may lack the repo's dependencies:

    .venv/bin/python benchmarks/gpu_step_times.py --predict-only    # here: writes results/gpu_step_times_prior.json
    PYTHONPATH=libs python3 benchmarks/gpu_step_times.py            # GPU host, repo root: measures
    .venv/bin/python benchmarks/gpu_step_times.py --fit             # here: refits the factors on --out's steps

The measuring mode needs only torch; it computes the prior itself when hetmesh imports, else reads the prior
file. It writes --out (results/gpu_step_times.json): per shape the predicted and measured seconds and
measured / predicted, plus the GPU name and the torch and CUDA versions, and prints a table. `--tiny` runs a
2-layer, 256-wide model on small shapes (on the CPU when there is no GPU; CUDA graphs need a GPU) to check the
script end to end; its shapes have no prior. `--fit` adds to --out the cost model's factors refitted on the
measured steps (hetmesh.costmodel.calibrate) with each shape's error before and after, and with it left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL, ACCEL = "llama-3.1-8b", "nvidia-h100"
PRIOR = ROOT / "results" / "gpu_step_times_prior.json"


@dataclass(frozen=True)
class Shapes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    prompts: tuple[int, ...]
    batches: tuple[int, ...]
    context: int
    mixed: tuple[tuple[int, int], ...]  # (prefill chunk, decodes) in one step, as continuous batching runs them


FULL = Shapes(4096, 32, 32, 8, 128, 14336, 128256, (512, 2048, 8192), (1, 8, 32, 64, 128), 1024,
              ((512, 32), (512, 64), (2048, 32), (2048, 64)))
TINY = Shapes(256, 2, 4, 2, 64, 512, 1024, (64, 128), (1, 4), 64, ((64, 4),))


def predictions(s: Shapes) -> dict:
    """The cost model's seconds per shape (needs the repo's hetmesh package and its dependencies)."""
    sys.path.insert(0, str(ROOT / "libs"))
    from hetmesh.costmodel.catalog import accelerator, model_spec
    from hetmesh.costmodel.model import CostModel

    cm = CostModel(accelerator(ACCEL), model_spec(MODEL), devices=1)
    return {"model": MODEL, "accelerator": ACCEL, "devices": 1, "efficiency": asdict(cm.eff),
            "decode_context": s.context,
            "prefill_s": {str(n): cm.prefill_time(n, 0) for n in s.prompts},
            "decode_s": {str(b): cm.decode_step_time(b, b * s.context) for b in s.batches},
            "mixed_s": {f"{c}+{b}": cm.step_time([(c, 0)], [s.context] * b) for c, b in s.mixed}}


def fit(results: dict) -> dict:
    """The cost model's factors refitted (hetmesh.costmodel.calibrate, least squares on relative error) on
    the measured steps (decode: its CUDA-graph times, as engines run decode): does the roofline's shape
    fit the real chip once its levels are learned? Also each shape left out of the fit in turn."""
    sys.path.insert(0, str(ROOT / "libs"))
    import numpy as np

    from hetmesh.costmodel.calibrate import Sample, calibrate, relative_errors
    from hetmesh.costmodel.catalog import accelerator, model_spec
    from hetmesh.costmodel.model import CostModel

    ctx = results["model_shape"]["context"]
    samples = [Sample.prefill(r["tokens"], r["measured_s"]) for r in results["prefill"]]
    samples += [Sample.decode(r["batch"], ctx, r["graph_s"]) for r in results["decode"] if r.get("graph_s")]
    names = [f"prefill {r['tokens']}" for r in results["prefill"]]
    names += [f"decode {r['batch']}x{ctx}" for r in results["decode"] if r.get("graph_s")]
    mixed = [r for r in results.get("mixed", []) if r.get("graph_s")]
    samples += [Sample(((r["chunk"], 0),), (ctx,) * r["batch"], r["graph_s"]) for r in mixed]
    names += [f"mixed {r['chunk']}+{r['batch']}x{ctx}" for r in mixed]

    def model(eff=None) -> CostModel:
        kw = {"efficiency": eff} if eff is not None else {}
        return CostModel(accelerator(ACCEL), model_spec(MODEL), devices=1, **kw)

    prior_err = relative_errors(model(), samples)
    eff = calibrate(model(), samples, fit_per_seq=True)
    fitted_err = relative_errors(model(eff), samples)
    held_out = []
    for i in range(len(samples)):
        rest = samples[:i] + samples[i + 1:]
        held_out.append(float(relative_errors(model(calibrate(model(), rest, fit_per_seq=True)), [samples[i]])[0]))
    return {"efficiency": asdict(eff),
            "shapes": [{"shape": n, "prior_error": float(a), "fitted_error": float(b), "held_out_error": c}
                       for n, a, b, c in zip(names, prior_err, fitted_err, held_out, strict=True)],
            "median_abs_error": {"prior": float(np.median(np.abs(prior_err))),
                                 "fitted": float(np.median(np.abs(fitted_err))),
                                 "held_out": float(np.median(np.abs(held_out)))}}


def load_prior(path: Path) -> dict:
    """Predictions computed here when hetmesh imports, else the committed prior file, else none."""
    try:
        return predictions(FULL)
    except ImportError as e:
        print(f"hetmesh not importable ({e}); reading {path}", flush=True)
    return json.loads(path.read_text()) if path.exists() else {}


# ---- measurement: torch only ----

def build_weights(s: Shapes, device, dtype) -> dict:
    """Random weights of the model, small normal values, allocated and filled on `device`."""
    import torch

    def w(*shape):
        return torch.empty(*shape, device=device, dtype=dtype).normal_(0.0, 0.02)

    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    layers = [{"ln1": torch.ones(s.hidden, device=device, dtype=dtype), "qkv": w(qkv, s.hidden),
               "o": w(s.hidden, s.heads * s.head_dim),
               "ln2": torch.ones(s.hidden, device=device, dtype=dtype), "gate_up": w(2 * s.inter, s.hidden),
               "down": w(s.hidden, s.inter)} for _ in range(s.layers)]
    cos, sin = rope_table(s, device, dtype)
    return {"embed": w(s.vocab, s.hidden), "layers": layers, "norm": torch.ones(s.hidden, device=device, dtype=dtype),
            "lm_head": w(s.vocab, s.hidden), "cos": cos, "sin": sin}


def rope_table(s: Shapes, device, dtype, theta: float = 500000.0):
    """cos and sin of the rotary angles, (positions, head_dim / 2), precomputed once as engines do."""
    import torch

    half, n = s.head_dim // 2, max(*s.prompts, s.context)
    inv = 1.0 / theta ** (torch.arange(half, device=device, dtype=torch.float32) / half)
    ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x, cos, sin):
    """Rotary embedding of x (..., seq, head_dim) with cos, sin (seq, head_dim / 2), rotate-half layout."""
    import torch

    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mlp(x, lw):
    import torch.nn.functional as F

    gate, up = (x @ lw["gate_up"].T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ lw["down"].T


def prefill(W: dict, s: Shapes, ids):
    """One prompt (1, T) through the model, causal attention, no cache; greedy next token."""
    import torch.nn.functional as F

    T, hd, g = ids.shape[1], s.head_dim, s.heads // s.kv_heads
    cos, sin = W["cos"][:T], W["sin"][:T]
    x = W["embed"][ids[0]]
    for lw in W["layers"]:
        h = F.rms_norm(x, (s.hidden,), lw["ln1"], 1e-5)
        q, k, v = (h @ lw["qkv"].T).split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], dim=-1)
        q = rope(q.view(T, s.heads, hd).transpose(0, 1), cos, sin)
        k = rope(k.view(T, s.kv_heads, hd).transpose(0, 1), cos, sin).repeat_interleave(g, dim=0)
        v = v.view(T, s.kv_heads, hd).transpose(0, 1).repeat_interleave(g, dim=0)
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        x = x + a.transpose(0, 1).reshape(T, -1) @ lw["o"].T
        x = x + mlp(F.rms_norm(x, (s.hidden,), lw["ln2"], 1e-5), lw)
    last = F.rms_norm(x[-1:], (s.hidden,), W["norm"], 1e-5)
    return (last @ W["lm_head"].T).argmax(-1)


def decode_step(W: dict, s: Shapes, ids, caches):
    """One token for each of B sequences (ids (B,)); writes its K/V at slot context-1 of caches
    [(k, v) of (B, kv_heads, context, head_dim)] and attends to all `context` slots; greedy next tokens."""
    import torch.nn.functional as F

    B, hd, g = ids.shape[0], s.head_dim, s.heads // s.kv_heads
    cos, sin = W["cos"][s.context - 1:s.context], W["sin"][s.context - 1:s.context]
    x = W["embed"][ids]
    for lw, (kc, vc) in zip(W["layers"], caches, strict=True):
        h = F.rms_norm(x, (s.hidden,), lw["ln1"], 1e-5)
        q, k, v = (h @ lw["qkv"].T).split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], dim=-1)
        q = rope(q.view(B, s.heads, 1, hd), cos, sin).view(B, s.kv_heads, g, hd)  # grouped heads as query rows
        kc[:, :, -1] = rope(k.view(B, s.kv_heads, 1, hd), cos, sin)[:, :, 0]
        vc[:, :, -1] = v.view(B, s.kv_heads, hd)
        a = F.scaled_dot_product_attention(q, kc, vc)  # no mask: every cached slot is visible
        x = x + a.reshape(B, -1) @ lw["o"].T
        x = x + mlp(F.rms_norm(x, (s.hidden,), lw["ln2"], 1e-5), lw)
    return (F.rms_norm(x, (s.hidden,), W["norm"], 1e-5) @ W["lm_head"].T).argmax(-1)


def mixed_step(W: dict, s: Shapes, chunk, ids, caches):
    """One step of a prompt chunk (1, C) and B decodes (ids (B,), caches as decode_step's), their tokens through
    the GEMMs together (continuous batching), attention apart: causal over the chunk, the decodes over their
    caches; greedy next tokens of the chunk's last position and of each decode."""
    import torch
    import torch.nn.functional as F

    C, B, hd, g = chunk.shape[1], ids.shape[0], s.head_dim, s.heads // s.kv_heads
    cp, sp = W["cos"][:C], W["sin"][:C]
    cd, sd = W["cos"][s.context - 1:s.context], W["sin"][s.context - 1:s.context]
    x = torch.cat((W["embed"][chunk[0]], W["embed"][ids]))
    for lw, (kc, vc) in zip(W["layers"], caches, strict=True):
        h = F.rms_norm(x, (s.hidden,), lw["ln1"], 1e-5)
        q, k, v = (h @ lw["qkv"].T).split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], dim=-1)
        qp = rope(q[:C].view(C, s.heads, hd).transpose(0, 1), cp, sp)
        kp = rope(k[:C].view(C, s.kv_heads, hd).transpose(0, 1), cp, sp).repeat_interleave(g, dim=0)
        vp = v[:C].view(C, s.kv_heads, hd).transpose(0, 1).repeat_interleave(g, dim=0)
        ap = F.scaled_dot_product_attention(qp[None], kp[None], vp[None], is_causal=True)[0]
        qd = rope(q[C:].view(B, s.heads, 1, hd), cd, sd).view(B, s.kv_heads, g, hd)
        kc[:, :, -1] = rope(k[C:].view(B, s.kv_heads, 1, hd), cd, sd)[:, :, 0]
        vc[:, :, -1] = v[C:].view(B, s.kv_heads, hd)
        ad = F.scaled_dot_product_attention(qd, kc, vc)
        x = x + torch.cat((ap.transpose(0, 1).reshape(C, -1), ad.reshape(B, -1))) @ lw["o"].T
        x = x + mlp(F.rms_norm(x, (s.hidden,), lw["ln2"], 1e-5), lw)
    last = F.rms_norm(x[C - 1:], (s.hidden,), W["norm"], 1e-5)
    return (last @ W["lm_head"].T).argmax(-1)


def timed(fn, device, warmup: int, repeats: int, iters: int) -> float:
    """Median seconds of one call over `repeats` runs of `iters` calls each, after `warmup` calls."""
    import time

    import torch

    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) / iters)
    return statistics.median(out)


def graph_of(fn, device):
    """fn captured in a CUDA graph (warmed up on a side stream first); returns the replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def measure(s: Shapes, reps: int) -> dict:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.inference_mode():
        W = build_weights(s, device, dtype)
        nparams = sum(p.numel() for lw in W["layers"] for p in lw.values()) + 2 * s.vocab * s.hidden
        print(f"weights built on {device}: {nparams / 1e9:.3f}B params", flush=True)
        pf = {}
        for n in s.prompts:
            ids = torch.randint(0, s.vocab, (1, n), device=device)
            pf[n] = timed(partial(prefill, W, s, ids), device, 2, reps, 1)
            print(f"prefill {n:>6} tokens: {pf[n] * 1e3:9.3f} ms", flush=True)
        bmax = max(s.batches)
        full = [(torch.empty(bmax, s.kv_heads, s.context, s.head_dim, device=device, dtype=dtype).normal_(),
                 torch.empty(bmax, s.kv_heads, s.context, s.head_dim, device=device, dtype=dtype).normal_())
                for _ in range(s.layers)]
        dec = {}
        for b in s.batches:
            caches = [(k[:b], v[:b]) for k, v in full]
            ids = torch.randint(0, s.vocab, (b,), device=device)
            step = partial(decode_step, W, s, ids, caches)
            eager = timed(step, device, 3, reps, 5)
            graph = timed(graph_of(step, device), device, 3, reps, 20) if device.type == "cuda" else None
            dec[b] = (eager, graph)
            gtxt = f"{graph * 1e3:9.3f} ms" if graph is not None else "  (no GPU)"
            print(f"decode batch {b:>4} x {s.context}: eager {eager * 1e3:9.3f} ms, graph {gtxt}", flush=True)
        mix = {}
        for c, b in s.mixed:
            caches = [(k[:b], v[:b]) for k, v in full]
            chunk = torch.randint(0, s.vocab, (1, c), device=device)
            ids = torch.randint(0, s.vocab, (b,), device=device)
            step = partial(mixed_step, W, s, chunk, ids, caches)
            eager = timed(step, device, 2, reps, 3)
            graph = timed(graph_of(step, device), device, 2, reps, 5) if device.type == "cuda" else None
            mix[c, b] = (eager, graph)
            gtxt = f"{graph * 1e3:9.3f} ms" if graph is not None else "  (no GPU)"
            print(f"mixed {c:>5} + {b:>4} x {s.context}: eager {eager * 1e3:9.3f} ms, graph {gtxt}", flush=True)
    cuda = device.type == "cuda"
    machine = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "cuda": torch.version.cuda, "dtype": str(dtype).removeprefix("torch.")}
    return {"machine": machine, "prefill": pf, "decode": dec, "mixed": mix}


def ratio(measured: float | None, predicted: float | None) -> float | None:
    return measured / predicted if measured is not None and predicted else None


def report(s: Shapes, m: dict, prior: dict) -> dict:
    """Rows of predicted vs measured seconds per shape (pure)."""
    pp, pd = prior.get("prefill_s", {}), prior.get("decode_s", {})
    if prior.get("decode_context", s.context) != s.context:
        pd = {}
    prefill_rows = [{"tokens": n, "predicted_s": pp.get(str(n)), "measured_s": t, "ratio": ratio(t, pp.get(str(n)))}
                    for n, t in m["prefill"].items()]
    decode_rows = [{"batch": b, "context": s.context, "predicted_s": pd.get(str(b)), "eager_s": e, "graph_s": g,
                    "ratio_eager": ratio(e, pd.get(str(b))), "ratio_graph": ratio(g, pd.get(str(b)))}
                   for b, (e, g) in m["decode"].items()]
    pm = prior.get("mixed_s", {}) if pd else {}
    mixed_rows = [{"chunk": c, "batch": b, "context": s.context, "predicted_s": pm.get(f"{c}+{b}"), "eager_s": e,
                   "graph_s": g, "ratio_eager": ratio(e, pm.get(f"{c}+{b}")), "ratio_graph": ratio(g, pm.get(f"{c}+{b}"))}
                  for (c, b), (e, g) in m["mixed"].items()]
    return {"machine": m["machine"], "model_shape": asdict(s),
            "prior": {k: prior.get(k) for k in ("model", "accelerator", "devices", "efficiency")},
            "prefill": prefill_rows, "decode": decode_rows, "mixed": mixed_rows}


def table(r: dict) -> str:
    def f(x, scale=1e3, fmt="{:10.3f}"):
        return fmt.format(x * scale) if x is not None else f"{'-':>{len(fmt.format(0.0))}}"

    lines = [f"{r['machine']}", f"{'shape':<22}{'pred ms':>10}{'eager ms':>10}{'graph ms':>10}"
             f"{'eager/pred':>11}{'graph/pred':>11}"]
    for p in r["prefill"]:
        lines.append(f"{'prefill ' + str(p['tokens']):<22}{f(p['predicted_s'])}{f(p['measured_s'])}{f(None)}"
                     f"{f(p['ratio'], 1, '{:11.2f}')}{f(None, 1, '{:11.2f}')}")
    for d in r["decode"]:
        lines.append(f"{'decode ' + str(d['batch']) + 'x' + str(d['context']):<22}{f(d['predicted_s'])}"
                     f"{f(d['eager_s'])}{f(d['graph_s'])}{f(d['ratio_eager'], 1, '{:11.2f}')}"
                     f"{f(d['ratio_graph'], 1, '{:11.2f}')}")
    for d in r.get("mixed", []):
        lines.append(f"{'mixed ' + str(d['chunk']) + '+' + str(d['batch']) + 'x' + str(d['context']):<22}"
                     f"{f(d['predicted_s'])}{f(d['eager_s'])}{f(d['graph_s'])}{f(d['ratio_eager'], 1, '{:11.2f}')}"
                     f"{f(d['ratio_graph'], 1, '{:11.2f}')}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--predict-only", action="store_true", help="write the cost model's prior and exit")
    ap.add_argument("--prior", type=Path, default=PRIOR)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_step_times.json")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256, small shapes (CPU check)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fit", action="store_true",
                    help="refit the cost model's factors on --out's measurements (here, with hetmesh) and add them")
    a = ap.parse_args()
    if a.fit:
        r = json.loads(a.out.read_text())
        r["fit"] = fit(r)
        a.out.write_text(json.dumps(r, indent=2) + "\n")
        print(json.dumps(r["fit"], indent=2), flush=True)
        return
    if a.predict_only:
        a.prior.parent.mkdir(parents=True, exist_ok=True)
        a.prior.write_text(json.dumps(predictions(FULL), indent=2) + "\n")
        print(f"wrote {a.prior}", flush=True)
        return
    s = TINY if a.tiny else FULL
    prior = {} if a.tiny else load_prior(a.prior)
    r = report(s, measure(s, a.repeats), prior)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(r, indent=2) + "\n")
    print(table(r), flush=True)
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
