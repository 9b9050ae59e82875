"""Real vLLM through the whole mesh vs the same engine called directly, same model, same machine.

Direct: vLLM's own AsyncLLM in this process (no Hetmesh code), greedy, streamed (DELTA outputs).
Mesh: the gateway (openai client, SSE) -> scheduler -> one `vllm` worker process -> back, the same
vLLM settings. Both run the tiny random-weight Llama (hetmesh.engines.vllm_tiny) on the CPU, one
request at a time: TTFT from the request to the first token, TPOT = (last token - first token) /
(tokens - 1). The direct run's prefill and decode timings are also fitted into cost-model
efficiency factors (hetmesh.costmodel.calibrate) and written to the calibration file named by
--calibration, keyed "<accelerator label>/<model>" like the shipped efficiency.json.

    python benchmarks/vllm_mesh_vs_direct.py [--requests 8] [--prompt-tokens 512] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

BLOCK = 128
ACCEL = "nvidia-h100"  # the cost model's label of these workers: vLLM runs on the CPU
CLUSTER = """
[mesh]
heartbeat_timeout_s = 5.0
stall_timeout_s = 120.0
[scheduler]
policy = "least_loaded"
[[models]]
name = "tiny"
spec = "{model}/config.json"
tokenizer = "{model}/tokenizer.json"
path = "{model}"
max_context = 2048
block_size = {block}
dtype = "fp32"
[[workers]]
name = "cpu"
model = "tiny"
accelerator = "{accel}"
engine = "vllm"
max_batch = 8
"""


def prompts(model: Path, n: int, tokens: int) -> list[list[int]]:
    from hetmesh.tokenizer import HFTokenizer

    tok = HFTokenizer(str(model / "tokenizer.json"))
    out = []
    for i in range(n):  # distinct from the first block on: no prefix-cache hits between requests
        ids = tok.encode(f"request {i}: " + "the mesh serves models on mixed accelerators " * (tokens // 4))
        out.append(ids[:tokens])
    return out


def summarize(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3, "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
            "tpot_p50_ms": statistics.median(tpot) * 1e3, "tpot_mean_ms": statistics.fmean(tpot) * 1e3}


async def timed_streams(llm: Any, ps: list[list[int]], max_tokens: int,
                        tag: str) -> list[tuple[list[int], float, float, int]]:
    """Each prompt through vLLM's AsyncLLM alone, one at a time, greedy: (prompt, TTFT s, TPOT s, tokens);
    the first prompt runs once more before them as a warm-up, not reported."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    got = []
    for i, p in enumerate([ps[0], *ps]):
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=p), sp, request_id=f"{tag}-{i}"):
            k = len(out.outputs[0].token_ids)
            if k and not first:
                first = time.perf_counter()
            n += k
            last = time.perf_counter()
        if i:
            got.append((p, first - t0, (last - first) / (n - 1), n))
    return got


async def direct(model: Path, ps: list[list[int]], max_tokens: int) -> tuple[dict[str, float], list[Any]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from hetmesh.costmodel.calibrate import Sample

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model), dtype="float32", max_model_len=2048, block_size=BLOCK, max_num_seqs=8,
        enable_prefix_caching=True, enforce_eager=True, disable_log_stats=True))
    ttft, tpot, samples = [], [], []
    try:
        for p, first_s, tpot_s, n in await timed_streams(llm, ps, max_tokens, "direct"):
            ttft.append(first_s)
            tpot.append(tpot_s)
            samples += [Sample.prefill(len(p), first_s), Sample.decode(1, len(p) + n // 2, tpot_s)]
    finally:
        llm.shutdown()
    return summarize(ttft, tpot), samples


async def through_mesh(url: str, ps: list[list[int]], max_tokens: int) -> dict[str, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    ttft, tpot = [], []
    for i, p in enumerate([ps[0], *ps]):
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        stream = await client.completions.create(model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for c in stream:
            if c.choices and c.choices[0].text:
                if not first:
                    first = time.perf_counter()
                last = time.perf_counter()
            if c.usage is not None:
                n = c.usage.completion_tokens
        if i:
            ttft.append(first - t0)
            tpot.append((last - first) / (n - 1))
    await client.close()
    return summarize(ttft, tpot)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="results/vllm_mesh_vs_direct.json")
    ap.add_argument("--calibration", default="results/vllm_cpu_efficiency.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from loadgen import cpu_ticks, steal_fraction

    from hetmesh.costmodel import CostModel, accelerator, model_spec, save_efficiencies
    from hetmesh.costmodel.calibrate import calibrate, relative_errors
    from hetmesh.engines.vllm_tiny import build
    from hetmesh.launcher import Mesh

    d = Path(tempfile.mkdtemp(prefix="hetmesh-vllm-bench-"))
    model = build(d / "model")
    ps = prompts(model, args.requests, args.prompt_tokens)
    t0 = cpu_ticks()
    direct_row, samples = asyncio.run(direct(model, ps, args.max_tokens))
    (d / "cluster.toml").write_text(CLUSTER.format(model=model, block=BLOCK, accel=ACCEL))
    with Mesh(d / "cluster.toml", gateway_port=0, log_dir=d / "logs") as mesh:
        mesh.wait_ready(300)
        mesh_row = asyncio.run(through_mesh(mesh.url, ps, args.max_tokens))
    steal = steal_fraction(t0, cpu_ticks())
    over = {k: mesh_row[k] / direct_row[k] - 1.0 for k in direct_row}

    cm = CostModel(accelerator(ACCEL), model_spec(str(model / "config.json")))
    eff = calibrate(cm, samples)
    fitted = CostModel(accelerator(ACCEL), model_spec(str(model / "config.json")), efficiency=eff)
    err = relative_errors(fitted, samples)
    save_efficiencies(args.calibration, {f"{ACCEL}/tiny-llama-cpu": eff},
                      note="Fitted by benchmarks/vllm_mesh_vs_direct.py from the vllm engine's measured prefill and "
                           "decode times (vLLM CPU build, tiny random Llama, this 2-core machine); the accelerator "
                           "key is the label the CPU workers carry in the cluster files. Load with "
                           "HETMESH_EFFICIENCY=<this file>.")

    t = Table(title=f"vLLM CPU, tiny Llama: direct AsyncLLM vs through the mesh ({args.requests} requests, "
                    f"{args.prompt_tokens} prompt / {args.max_tokens} output tokens, one at a time)")
    for c in ("path", "TTFT p50 ms", "TTFT mean ms", "TPOT p50 ms", "TPOT mean ms"):
        t.add_column(c, justify="right")
    for name, r in (("direct AsyncLLM", direct_row), ("mesh (gateway..worker)", mesh_row)):
        t.add_row(name, *(f"{r[k]:.2f}" for k in ("ttft_p50_ms", "ttft_mean_ms", "tpot_p50_ms", "tpot_mean_ms")))
    t.add_row("mesh / direct - 1", *(f"{over[k] * 100:+.1f}%" for k in ("ttft_p50_ms", "ttft_mean_ms", "tpot_p50_ms",
                                                                          "tpot_mean_ms")))
    Console(width=160).print(t)
    print(f"calibration: {eff} (max |error| {abs(err).max() * 100:.1f}% over {len(samples)} samples) -> "
          f"{args.calibration}; host CPU steal during the run {steal * 100:.1f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "direct": direct_row, "mesh": mesh_row, "mesh_over_direct": over,
        "tpot_target_met": over["tpot_p50_ms"] < 0.05,
        "calibration": {"file": args.calibration, "key": f"{ACCEL}/tiny-llama-cpu", "max_rel_error": float(abs(err).max())},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "device": "CPU (no GPU)", "host_steal_share": steal},
        "config": vars(args)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
