"""Does a greedy vLLM stream continue with the undisturbed run's text after a migration? On the CPU, by dtype.

A migrated stream is re-submitted as prompt + the k tokens it already has: the new engine computes
those k tokens' KV in one prefill, where the undisturbed run made them one decode step at a time.
The two paths add in different orders, so their logits differ by rounding; greedy takes the argmax,
and where the top two logits of the undisturbed run are closer than that rounding the pick can flip,
and the text goes on differently from there (token for token it is still what vLLM generates for
prompt + k tokens: tests/vllm/test_mesh.py checks that through the mesh).

For each dtype, in a process of its own (vLLM's LLM class, the tiny random-weight model of
hetmesh.engines.vllm_tiny): every prompt's undisturbed greedy run (top-2 logprobs at each step), then
the continuation from prompt + k tokens for every k, prefilled whole (`--prefix-caching off`, the
default: a worker that never saw the stream) or over the blocks the undisturbed run left cached. A
flip is a continuation that is not the undisturbed tail. Printed and written to
results/vllm_migration_numerics[_cached].json: the flip rate; the rounding gap between the two paths (how far
the continuation's logprob of a token differs from the undisturbed run's, for the same token at the
same position, over the positions before any flip); the undisturbed run's top-1 minus top-2 logprob
margin where a flip happened, and its smallest margin anywhere. And the text at the join: the client's text (what
the stream had sent before the move, then the continuation's text from vLLM, its detokenizer primed as a worker
primes it: hetmesh.engines.vllm_detok) against an undisturbed detokenizer's for the same tokens; where prompt + k
ends mid-character, also what vLLM's own priming (tokenizers' native DecodeStream prefill) would have sent.

    .venv/bin/python benchmarks/vllm_migration_numerics.py [--prompts 6] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# tokenizers' own class: the primer replaces what vLLM sees, not this name
from tokenizers.decoders import DecodeStream as _DecodeStream

DTYPES = ("float32", "bfloat16")
WORDS = ("the mesh serves models on mixed accelerators prefill decode cache block token worker scheduler gateway "
         "transfer latency throughput batch request stream prompt hello world quick brown fox").split()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160))) for _ in range(n)]


def one(model: str, dtype: str, prompts_path: str, tokens: int, ks: list[int], caching: bool) -> dict[str, Any]:
    """In the child process: the undisturbed runs and every continuation, for one dtype."""
    from tokenizers import Tokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hetmesh.engines import vllm_detok

    vllm_detok.install()  # as the worker does
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    llm = LLM(model=model, dtype=dtype, max_model_len=1024, enforce_eager=True, block_size=128,
              enable_prefix_caching=caching, seed=0)
    prompts = json.loads(Path(prompts_path).read_text())

    def run(ps: list[list[int]], n: list[int]) -> list[tuple[list[int], list[dict[int, float]], str]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                            [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in n],
                            use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()}
                                                for step in (o.outputs[0].logprobs or [])], o.outputs[0].text)
                for o in outs]

    base = run(prompts, [tokens] * len(prompts))  # one batch, like a busy worker
    cases = []
    for i, (ids, lps, _) in enumerate(base):
        margins = [_margin(step) for step in lps]
        conts = run([[*prompts[i], *ids[:k]] for k in ks], [tokens - k for k in ks])
        for k, (cids, clps, ctext) in zip(ks, conts, strict=True):
            ctx = [*prompts[i], *ids[:k]]
            head = vllm_detok.stepped_text(tok, prompts[i], ids[:k])  # what the stream had sent before the move
            want = vllm_detok.stepped_text(tok, prompts[i], ids[:k] + cids)  # an undisturbed detokenizer, the same tokens
            native = _DecodeStream(ids=ctx, skip_special_tokens=True)
            native_text = "".join(x for t in cids if (x := native.step(tok, t)) is not None)
            tail = ids[k:]
            first = next((j for j, (a, b) in enumerate(zip(cids, tail, strict=True)) if a != b), None)
            same = len(tail) if first is None else first
            gaps = [abs(clps[j][tail[j]] - lps[k + j][tail[j]]) for j in range(same)]
            cases.append({"prompt": i, "k": k, "flipped": first is not None,
                          "first_diff": None if first is None else k + first,
                          "margin_at_flip": None if first is None else margins[k + first],
                          "max_gap_before": max(gaps) if gaps else 0.0,
                          "min_margin_after_k": min(margins[k:]),
                          "mid_character": tok.decode(ctx).endswith("\ufffd"), "text_joins": head + ctext == want,
                          "native_text_joins": head + native_text == want})
    return {"dtype": dtype, "cases": cases}


def _margin(step: dict[int, float]) -> float:
    top = sorted(step.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def summary(r: dict[str, Any]) -> dict[str, Any]:
    cs = r["cases"]
    flips = [c for c in cs if c["flipped"]]
    return {"dtype": r["dtype"], "continuations": len(cs), "flipped": len(flips),
            "flip_rate": round(len(flips) / len(cs), 3) if cs else None,
            "max_rounding_gap": max(c["max_gap_before"] for c in cs),
            "margins_at_flips": sorted(c["margin_at_flip"] for c in flips),
            "min_margin_unflipped": min((c["min_margin_after_k"] for c in cs if not c["flipped"]), default=None),
            "mid_character": sum(c["mid_character"] for c in cs),
            "text_join_wrong": sum(not c["text_joins"] for c in cs),
            "native_text_join_wrong": sum(not c["native_text_joins"] for c in cs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per undisturbed run")
    ap.add_argument("--ks", default="all",
                    help="migration points: tokens streamed before the move (all: every k from 1 to tokens - 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefix-caching", choices=["off", "on"], default="off",
                    help="off: a continuation prefills prompt + k whole, as on a worker that never saw the stream; "
                         "on: it finds the blocks the undisturbed run filled (prompt and generated tokens) cached")
    ap.add_argument("--out", default="", help="default results/vllm_migration_numerics[_cached].json")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "DTYPE", "PROMPTS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    ks = list(range(1, args.tokens)) if args.ks == "all" else [int(k) for k in args.ks.split(",")]
    caching = args.prefix_caching == "on"
    out_path = args.out or f"results/vllm_migration_numerics{'_cached' if caching else ''}.json"
    if args.one:
        res = one(*args.one, args.tokens, ks, caching)
        print("RESULT " + json.dumps(res))
        return
    from hetmesh.engines.vllm_tiny import build
    from hetmesh.tokenizer import HFTokenizer

    d = Path(tempfile.mkdtemp(prefix="hetmesh-numerics-"))
    model = build(d / "tiny")
    tok = HFTokenizer(str(model / "tokenizer.json"))
    (d / "prompts.json").write_text(json.dumps([tok.encode(t) for t in texts(args.prompts, args.seed)]))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    results, t0 = [], time.monotonic()
    for dtype in DTYPES:
        p = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--ks", args.ks,
                            "--prefix-caching", args.prefix_caching, "--one",
                            str(model), dtype, str(d / "prompts.json")], env=env, capture_output=True, text=True,
                           timeout=900)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise SystemExit(f"{dtype}: exit {p.returncode}\n{p.stderr[-3000:]}")
        results.append(json.loads(line[7:]))
    sums = [summary(r) for r in results]
    out = {"prefix_caching": caching,
           "model": "hetmesh.engines.vllm_tiny (random weights, hidden 256, 2 layers)", "prompts": args.prompts,
           "tokens": args.tokens, "ks": ks, "summary": sums, "cases": {r["dtype"]: r["cases"] for r in results},
           "wall_s": round(time.monotonic() - t0, 1),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'dtype':10} {'flipped':>12} {'rounding gap (max)':>19} {'margin at flips':>30} {'min margin unflipped':>21}"
          f" {'mid-char':>9} {'join wrong':>11} {'native wrong':>13}")
    for s in sums:
        fl = ", ".join(f"{m:.2g}" for m in s["margins_at_flips"][:4]) or "-"
        mu = s["min_margin_unflipped"]
        print(f"{s['dtype']:10} {s['flipped']:>5}/{s['continuations']:<6} {s['max_rounding_gap']:>19.3g} {fl:>30} "
              f"{'-' if mu is None else f'{mu:.3g}':>21} {s['mid_character']:>9} {s['text_join_wrong']:>11} "
              f"{s['native_text_join_wrong']:>13}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
