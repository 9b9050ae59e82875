"""On a GPU host: real vLLM through the mesh, aggregated and disaggregated with both KV connectors, vs vLLM alone.

Prepared for a GPU run; it has not run yet (no GPU was lent when it was written), and docs/benchmarks.md's GPU
rows stay empty until it does. It installs nothing: run it inside the docker/vllm-cuda.Dockerfile image (vLLM's
official CUDA image plus Hetmesh; NixlConnector ships in it), with NATS and Redis reachable
(HETMESH_NATS_URL / HETMESH_REDIS_URL, e.g. the compose file's services; otherwise the launcher starts
nats-server and redis-server from PATH):

    python3 benchmarks/vllm_gpu_pd.py [--layers 8] [--prompt-tokens 2048] [--requests 16] [--tp 1]

The model: a Llama-3-8B-shaped config (hidden 4096, 32 heads, 8 KV heads of 128, bf16) with `--layers`
layers and random weights (hetmesh.engines.vllm_tiny.build: nothing is downloaded). Every engine shares the
one GPU (`--gpu-share` of its memory each); the runs go one after another:

1. vLLM alone: AsyncLLM in this process, greedy, streamed, one request at a time (TTFT, TPOT).
2. The mesh, aggregated: gateway -> scheduler -> one vLLM worker, the same requests by the openai client.
3. The mesh, disaggregated, per connector (`hetmesh`: the KV through kv-transfer's direct TCP stream;
   `nixl`: vLLM's NixlConnector, the decode engine reads the blocks the hand-over names): TTFT, TPOT,
   and for `hetmesh` the KV transfer (prefill worker's kv_sent start -> decode worker's kv_landed) vs
   raw loopback TCP of the same byte counts (hetmesh.loadgen.raw_tcp_mb_per_s, measured in the run).
   NIXL's own transfer time is vLLM's (its KV connector stats), not the mesh's: the script records the
   decode side's wait from the hand-over to its first token instead, and the NIXL line-rate row needs
   nixlbench (not in the image), so it is written as null.

Targets (issue 17): TTFT and TPOT through the mesh within +5% of vLLM alone; KV transfer >= 70% of line rate.
Writes --out (results/vllm_gpu_pd.json) with the machine (nvidia-smi's GPU name) noted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_mesh_vs_direct import summarize, timed_streams  # sibling script (benchmarks/ is on sys.path)

BLOCK = 16
CLUSTER = """
[mesh]
heartbeat_timeout_s = 10.0
stall_timeout_s = 300.0
[scheduler]
policy = "least_loaded"
[[models]]
name = "gpu"
spec = "{model}/config.json"
tokenizer = "{model}/tokenizer.json"
path = "{model}"
max_context = 8192
block_size = {block}
dtype = "bf16"
"""
GROUP = """
[[workers]]
name = "{name}"
model = "gpu"
accelerator = "nvidia-h100"
role = "{role}"
engine = "vllm"
devices = {tp}
[workers.vllm]
kv_connector = "{connector}"
gpu_memory_utilization = {share}
"""


async def alone(model: Path, ps: list[list[int]], max_tokens: int, tp: int, share: float) -> dict[str, float]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model), dtype="bfloat16", max_model_len=8192, block_size=BLOCK, enable_prefix_caching=True,
        tensor_parallel_size=tp, gpu_memory_utilization=share, disable_log_stats=True))
    try:
        got = await timed_streams(llm, ps, max_tokens, "alone")
    finally:
        llm.shutdown()
    return summarize([g[1] for g in got], [g[2] for g in got])


async def through_mesh(mesh: Any, ps: list[list[int]], max_tokens: int) -> tuple[dict[str, float], list[dict]]:
    """TTFT/TPOT by the openai client; the KV transfers and hand-overs from the services' own events."""
    import nats
    import openai

    from hetmesh import subjects
    from hetmesh.bus import decode_events

    nc = await nats.connect(mesh.nats_url)
    evs: dict[tuple[str, str], Any] = {}

    async def on_ev(m: Any) -> None:
        for e in decode_events(m.data):
            if e.kind in ("kv_sent", "kv_landed", "kv_handed_over", "kv_fallback"):
                evs[(e.request_id, e.kind)] = e

    await nc.subscribe(subjects.EVENTS_ALL, cb=on_ev)
    client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=600)
    ttft, tpot, kv = [], [], []
    for i, p in enumerate([ps[0], *ps]):
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        rid = ""
        stream = await client.completions.create(model="gpu", prompt=p, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for c in stream:
            rid = rid or c.id.split("-", 1)[1]
            if c.choices and c.choices[0].text:
                first = first or time.perf_counter()
                last = time.perf_counter()
            if c.usage is not None:
                n = c.usage.completion_tokens
        if not i:
            continue
        ttft.append(first - t0)
        tpot.append((last - first) / (n - 1))
        await asyncio.sleep(0.2)  # the events trail the last chunk
        sent, landed = evs.get((rid, "kv_sent")), evs.get((rid, "kv_landed"))
        row: dict[str, Any] = {"request_id": rid, "prompt_tokens": len(p),
                               "fallback": (rid, "kv_fallback") in evs, "handed_over": (rid, "kv_handed_over") in evs}
        if sent is not None and landed is not None:
            start = sent.ts - float(sent.detail["duration_s"])
            row.update(nbytes=int(landed.detail["bytes_received"]), seconds=landed.ts - start)
        kv.append(row)
    await client.close()
    await nc.close()
    return summarize(ttft, tpot), kv


def run_mesh(d: Path, name: str, groups: str, model: Path, ps: list[list[int]], max_tokens: int) -> tuple[dict, list]:
    from hetmesh.launcher import Mesh

    cluster = d / f"cluster-{name}.toml"
    cluster.write_text(CLUSTER.format(model=model, block=BLOCK) + groups)
    mesh = Mesh(cluster, gateway_port=0, log_dir=d / f"logs-{name}",
                nats_url=os.environ.get("HETMESH_NATS_URL", ""), redis_url=os.environ.get("HETMESH_REDIS_URL", ""))
    try:
        mesh.start(ready_timeout_s=900)
        return asyncio.run(through_mesh(mesh, ps, max_tokens))
    finally:
        mesh.stop()


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "unknown GPU"
    except OSError:
        return "no nvidia-smi"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gpu-share", type=float, default=0.3, help="gpu_memory_utilization of each engine")
    ap.add_argument("--connectors", nargs="+", default=["hetmesh", "nixl"], choices=["hetmesh", "nixl"])
    ap.add_argument("--out", default="results/vllm_gpu_pd.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from loadgen import raw_tcp_mb_per_s

    from hetmesh.engines.vllm_tiny import build
    from hetmesh.tokenizer import HFTokenizer

    d = Path(tempfile.mkdtemp(prefix="hetmesh-gpu-pd-"))
    model = build(d / "model", hidden=4096, layers=args.layers, heads=32, kv_heads=8, max_positions=8192)
    tok = HFTokenizer(str(model / "tokenizer.json"))
    ps = [tok.encode(f"request {i}: " + "the mesh serves models on mixed accelerators " * args.prompt_tokens)
          [:args.prompt_tokens] for i in range(args.requests)]
    share, tp = args.gpu_share, args.tp
    rows: dict[str, Any] = {"vllm alone": asyncio.run(alone(model, ps, args.max_tokens, tp, share))}
    kv: dict[str, list] = {}
    both = GROUP.format(name="agg", role="both", tp=tp, connector="", share=share)
    rows["mesh aggregated"], _ = run_mesh(d, "agg", both, model, ps, args.max_tokens)
    for c in args.connectors:
        groups = (GROUP.format(name="p", role="prefill", tp=tp, connector=c, share=share)
                  + GROUP.format(name="d", role="decode", tp=tp, connector=c, share=share))
        rows[f"mesh P/D {c}"], kv[c] = run_mesh(d, f"pd-{c}", groups, model, ps, args.max_tokens)
    base = rows["vllm alone"]
    over = {k: {m: r[m] / base[m] - 1.0 for m in base} for k, r in rows.items() if k != "vllm alone"}
    transfers = [r for r in kv.get("hetmesh", []) if "seconds" in r]
    sizes = sorted({r["nbytes"] for r in transfers})
    tcp = raw_tcp_mb_per_s(sizes, 9, keep=True) if sizes else {}
    rate = [{"nbytes": r["nbytes"], "mb_per_s": r["nbytes"] / 1e6 / r["seconds"],
             "ratio_to_tcp": r["nbytes"] / 1e6 / r["seconds"] / tcp[r["nbytes"]]} for r in transfers]
    for name, r in rows.items():
        extra = "" if name == "vllm alone" else "  ({:+.1f}% TTFT, {:+.1f}% TPOT)".format(
            over[name]["ttft_p50_ms"] * 100, over[name]["tpot_p50_ms"] * 100)
        print(f"{name:22s} TTFT p50 {r['ttft_p50_ms']:9.2f} ms  TPOT p50 {r['tpot_p50_ms']:7.3f} ms{extra}")
    if rate:
        print(f"hetmesh KV transfer: median {statistics.median(x['mb_per_s'] for x in rate):.0f} MB/s, "
              f"{statistics.median(x['ratio_to_tcp'] for x in rate) * 100:.0f}% of raw TCP")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "rows": rows, "mesh_over_alone": over, "kv": kv, "hetmesh_kv_rate": rate, "raw_tcp_mb_per_s": tcp,
        "nixl_line_rate_mb_per_s": None,  # needs nixlbench, not in the image
        "targets": {"ttft_tpot_over_alone_max": 0.05, "kv_ratio_min": 0.7},
        "machine": {"gpu": gpu_name(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "config": vars(args)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
