"""The live `sim` engine and the offline simulator run one batching core: identical steps for one trace."""

from __future__ import annotations

import asyncio
import random

import pytest

from hetmesh.batching import Settings
from hetmesh.costmodel import server_model
from hetmesh.engines.base import EngineRequest
from hetmesh.engines.sampling import expected_completion
from hetmesh.engines.simulated import SimEngine
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.placement import RoundRobin
from hetmesh.protocol import Phase, Role, SamplingParams
from hetmesh.sim import SimConfig, Simulator, Trace, TraceRequest, pool
from hetmesh.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
BS = 16
# Small enough that prompts are chunked, the batch is full, and growth preempts.
SETTINGS = Settings(max_batch=4, kv_blocks=48, block_size=BS, step_tokens=96)


def _requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(97, 123) for _ in range(64)]  # four blocks that several prompts share
    out = []
    for _ in range(n):
        own = [rng.randrange(97, 123) for _ in range(rng.randrange(8, 200))]
        out.append(((shared if rng.random() < 0.5 else []) + own, rng.randrange(2, 60)))
    return out


async def _live(reqs: list[tuple[list[int], int]], phase: Phase) -> tuple[list[tuple[object, ...]], int]:
    e = SimEngine(TOK, server_model("nvidia-h100", "tiny-llama"), SETTINGS, time_scale=1e6)
    e.steps = []
    await e.start()
    try:
        ers = [EngineRequest(request_id=str(i), prompt_tokens=p, block_hashes=block_hashes("m", p, BS),
                             sampling=SamplingParams(max_tokens=out, ignore_eos=True), phase=phase)
               for i, (p, out) in enumerate(reqs)]
        for r in ers:  # all at once, before the engine's loop runs: the trace's arrivals at t=0
            await e.submit(r)

        async def collect(r: EngineRequest) -> list[int]:
            return [t for o in [o async for o in e.stream(r.request_id)] for t in o.token_ids]

        got = await asyncio.wait_for(asyncio.gather(*(collect(r) for r in ers)), 60)
        for r, ids in zip(ers, got, strict=True):
            want = expected_completion(TOK, r.prompt_tokens, r.sampling)[0]
            assert ids == (want[:1] if phase == Phase.PREFILL else want)  # preemption never changes the text
        preempted = e.stats().preempted
    finally:
        await e.close()
    return [_int_ids(s) for s in e.steps], preempted


def _int_ids(sig: tuple[object, ...]) -> tuple[object, ...]:
    chunks, n_dec, ctx, admitted = sig
    return (tuple((int(r), n, c) for r, n, c in chunks), n_dec, ctx, tuple(int(r) for r in admitted))  # type: ignore[union-attr, arg-type]


def _simulated(reqs: list[tuple[list[int], int]], disaggregated: bool) -> list[tuple[object, ...]]:
    kw = {"model": "tiny", "spec": "tiny-llama", "devices": 1, "max_batch": SETTINGS.max_batch,
          "kv_tokens": SETTINGS.kv_blocks * BS, "block_size": BS, "step_tokens": SETTINGS.step_tokens}
    workers = pool("w", 1, "nvidia-h100", Role.PREFILL if disaggregated else Role.BOTH, **kw)
    if disaggregated:
        workers += pool("d", 1, "nvidia-h100", Role.DECODE, **{**kw, "kv_tokens": 0})
    trace = Trace([TraceRequest(0.0, len(p), out, tuple(block_hashes("m", p, BS))) for p, out in reqs], BS)
    res = Simulator(workers, RoundRobin(), SimConfig(record_steps=True)).run(trace)
    assert len(res.records) == len(reqs) and not res.rejected
    return res.steps["w-0"]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_live_engine_and_simulator_take_identical_steps(seed: int) -> None:
    reqs = _requests(14, seed)
    live, preempted = await _live(reqs, Phase.FULL)
    sim = _simulated(reqs, disaggregated=False)
    assert len(live) > 30 and any(len(s[0]) > 1 for s in live)  # chunked prefills beside each other
    assert preempted > 0 or seed == 3  # memory runs out (seed 3's lengths happen to fit)
    assert live == sim


async def test_prefill_workers_take_identical_steps() -> None:
    reqs = _requests(14, 7)
    assert (await _live(reqs, Phase.PREFILL))[0] == _simulated(reqs, disaggregated=True)
