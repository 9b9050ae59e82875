"""A vLLM worker switches role without restarting its engine (the planner's RoleSwitch).

Every engine is built with its KV connector in `kv_role = "kv_both"` (vllm_engine.VllmEngine.engine_args):
vLLM then counts it as a KV producer and a KV consumer at once, and which one a request uses is the
request's own kv_transfer_params (`do_remote_decode` on a prefill, the hand-over's `do_remote_prefill` on a
decode). So the same running engine prefills for others, then decodes from others' KV, then serves
whole requests, with no restart: that is what a role switch needs of it. Two engines here, each started
once, swap roles twice; the text is the same as either engine's own aggregated run, and the decode side
computes only the first token's position (it really loaded the transferred KV).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hetmesh.engines.vllm_engine import VllmConfig, VllmEngine

from .test_engine import _disaggregated, _engine, _req, _run


def test_every_connector_is_built_for_both_roles(tmp_path: Path) -> None:
    for connector in ("hetmesh", "nixl"):
        e = VllmEngine(VllmConfig(model_dir=str(tmp_path), model_name="m", kv_connector=connector,
                                  spool_dir=str(tmp_path)))
        kv = e.engine_args().kv_transfer_config
        assert kv.kv_role == "kv_both" and kv.is_kv_producer and kv.is_kv_consumer


@pytest.fixture(scope="module")
async def pair(tiny_model: Path) -> AsyncIterator[tuple[VllmEngine, VllmEngine]]:
    a, b = _engine(tiny_model), _engine(tiny_model)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_engines_swap_prefill_and_decode_without_a_restart(pair: tuple[VllmEngine, VllmEngine],
                                                                 prompts: list[list[int]]) -> None:
    a, b = pair
    llms = (a.llm, b.llm)
    for i, (prefill, decode) in enumerate([(a, b), (b, a), (a, b)]):
        p = [11 + i, *prompts[i % len(prompts)]]  # shifted: nothing of it is in either prefix cache yet
        ids, last, computed = await _disaggregated(prefill, decode, f"swap-{i}", p)
        assert computed == 1  # the decode side loaded the prompt's KV, computed only the first token's position
        want, _ = await _run(decode, _req(f"swap-{i}-whole", p))  # the same engine serving both phases
        assert ids == want and last.completion_tokens == len(want)
    assert (a.llm, b.llm) == llms  # the very engines started once: nothing was rebuilt
