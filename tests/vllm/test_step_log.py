"""The `vllm` engine's step telemetry: each engine step as a StepSample from vLLM's per-iteration details."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hetmesh.engines.base import EngineRequest
from hetmesh.engines.vllm_engine import VllmConfig, VllmEngine
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import SamplingParams

from .conftest import BLOCK

MODEL = "tiny"


async def _run(engine: VllmEngine, rid: str, prompt: list[int], max_tokens: int) -> int:
    await engine.submit(EngineRequest(request_id=rid, prompt_tokens=prompt,
                                      block_hashes=block_hashes(MODEL, prompt, BLOCK),
                                      sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True)))
    n = 0
    async for out in engine.stream(rid):
        n += len(out.token_ids)
    return n


async def test_step_log_adds_up(tiny_model: Path, prompts: list[list[int]]) -> None:
    engine = VllmEngine(VllmConfig(model_dir=str(tiny_model), model_name=MODEL, block_size=BLOCK,
                                   max_model_len=1024, dtype="float32", kv_cache_gib=1, max_batch=8))
    await engine.start()
    try:
        assert engine.step_log() == []
        ps = prompts[:3]
        lens = [5, 9, 12]
        got = await asyncio.gather(*(_run(engine, f"s{i}", p, k) for i, (p, k) in enumerate(zip(ps, lens, strict=True))))
        assert got == lens
        await asyncio.sleep(0.2)  # the output handler records the last step right after handing its outputs out
        steps = engine.step_log()
        assert steps and all(s.seconds > 0 for s in steps)
        # Every token but each request's first comes from a decode step; every prompt token was prefilled or cached.
        assert sum(s.n_decode for s in steps) == sum(lens) - len(lens)
        assert sum(s.prefill_tokens + s.prefill_cached for s in steps) == sum(len(p) for p in ps)
        assert sum(s.prefill_seqs for s in steps) >= len(ps)
        # Each decode step reads the whole context so far: prompt + tokens before the one it computes.
        want = sum(len(p) + j for p, k in zip(ps, lens, strict=True) for j in range(1, k))
        assert sum(s.decode_context for s in steps) == want
        assert engine.step_log() == []  # drained
    finally:
        await engine.close()
