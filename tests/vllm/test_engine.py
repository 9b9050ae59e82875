"""The `vllm` engine (AsyncLLM in this process) behind hetmesh.engines.base, two engines per module:
`a` (aggregated and prefill side) and `b` (decode side), each with its own KV cache."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tokenizers import Tokenizer

from hetmesh.engines.base import EngineOutput, EngineRequest
from hetmesh.engines.vllm_detok import PrimedDecodeStream, stepped_text
from hetmesh.engines.vllm_engine import VllmConfig, VllmEngine
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import Phase, SamplingParams

from .conftest import BLOCK, MAX_TOKENS

MODEL = "tiny"


def _engine(model: Path) -> VllmEngine:
    return VllmEngine(VllmConfig(model_dir=str(model), model_name=MODEL, block_size=BLOCK, max_model_len=1024,
                                 dtype="float32", kv_cache_gib=1, max_batch=8))


@pytest.fixture(scope="module")
async def engines(tiny_model: Path) -> AsyncIterator[tuple[VllmEngine, VllmEngine]]:
    a, b = _engine(tiny_model), _engine(tiny_model)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


def _req(rid: str, prompt: list[int], phase: Phase = Phase.FULL, first: list[int] | None = None,
         max_tokens: int = MAX_TOKENS, handover: dict | None = None, priority: int = 0) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_tokens=prompt, block_hashes=block_hashes(MODEL, prompt, BLOCK),
                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                         phase=phase, first_token_ids=first or [], kv_transfer_params=handover, priority=priority)


async def _run(engine: VllmEngine, req: EngineRequest) -> tuple[list[int], EngineOutput]:
    await engine.submit(req)
    ids: list[int] = []
    last = None
    async for out in engine.stream(req.request_id):
        assert out.index == len(req.first_token_ids) + len(ids)
        ids += out.token_ids
        last = out
    assert last is not None and last.finished
    return ids, last


async def _disaggregated(a: VllmEngine, b: VllmEngine, rid: str, prompt: list[int],
                         perturb: bool = False) -> tuple[list[int], EngineOutput, int]:
    first, pout = await _run(a, _req(f"{rid}-p", prompt, Phase.PREFILL))
    assert len(first) == 1 and pout.finish_reason is None  # handed off, not ended
    kv = a.take_kv(f"{rid}-p")
    assert kv is not None and a.take_kv(f"{rid}-p") is None  # shipped once
    # vLLM's hand-over: the prefill output's kv_transfer_params, given to the decode request as they are.
    handover = pout.kv_transfer_params
    assert handover is not None and handover["do_remote_prefill"] is True
    h = handover["hetmesh"]
    assert h["tp_size"] == 1 and h["shard_bytes"] == [len(kv)] and h["num_tokens"] == len(prompt)
    if perturb:
        tensors = st_load(bytes(kv))
        gen = torch.Generator().manual_seed(0)
        for name, t in tensors.items():
            if not name.startswith("hetmesh."):
                tensors[name] = torch.randn(t.shape, generator=gen, dtype=t.dtype)
        noise = st_save(tensors)
        handover = {**handover, "hetmesh": {**h, "shard_bytes": [len(noise)]}}
        b.put_kv(rid, noise)
    else:  # as the KV stream lands it: straight into the mapped spool file the connector loads
        sink = b.kv_sink(rid, len(kv))
        assert sink.view is not None
        sink.view[:] = kv
        sink.commit()
    computed0 = b.stats().prompt_tokens_computed
    rest, dout = await _run(b, _req(rid, prompt, Phase.DECODE, first=first, handover=handover))
    return first + rest, dout, b.stats().prompt_tokens_computed - computed0


async def test_aggregated_equals_vllm_alone(engines: tuple[VllmEngine, VllmEngine], prompts: list[list[int]],
                                            reference: list[dict]) -> None:
    a, _ = engines
    for i, p in enumerate(prompts):
        ids, last = await _run(a, _req(f"agg-{i}", p))
        assert ids == reference[i]["token_ids"]
        assert last.finish_reason == "length" and last.completion_tokens == MAX_TOKENS
        assert last.prompt_tokens == len(p)


async def test_request_priority_reaches_vllms_priority_scheduler(engines: tuple[VllmEngine, VllmEngine],
                                                                  prompts: list[list[int]], reference: list[dict]) -> None:
    """vLLM refuses a priority other than 0 unless it schedules by priority: the engine runs it so, and the
    requests of other priorities are served alike (greedy: the same tokens)."""
    a, _ = engines
    for i, priority in ((0, -3), (1, 7)):
        ids, _ = await _run(a, _req(f"prio-{i}", prompts[i], priority=priority))
        assert ids == reference[i]["token_ids"]


async def test_disaggregated_equals_vllm_alone_and_decode_loads_the_prompt(
        engines: tuple[VllmEngine, VllmEngine], prompts: list[list[int]], reference: list[dict]) -> None:
    a, b = engines
    for i, p in enumerate(prompts):
        ids, last, computed = await _disaggregated(a, b, f"pd-{i}", p)
        assert ids == reference[i]["token_ids"]
        # The decode engine computed one position (the first token's), none of the prompt: it loaded it.
        assert computed == 1
        assert last.cached_tokens == len(p)
        assert last.completion_tokens == MAX_TOKENS and last.finish_reason == "length"


async def test_decode_output_depends_on_the_transferred_kv(engines: tuple[VllmEngine, VllmEngine],
                                                           prompts: list[list[int]]) -> None:
    # Same text after a transfer proves nothing if the engine quietly recomputed: noise instead of the
    # prompt's KV must change what the decode side generates.
    a, b = engines
    p = [3, *prompts[2]]  # shifted: no block of it is in b's prefix cache, so all of it must be loaded
    want, _ = await _run(a, _req("noise-ref", p))
    ids, _, computed = await _disaggregated(a, b, "noise", p, perturb=True)
    assert computed == 1
    assert ids[0] == want[0]  # the prefill side's token
    assert ids[1:] != want[1:]


async def test_decode_without_the_handover_computes_the_prompt(engines: tuple[VllmEngine, VllmEngine],
                                                              prompts: list[list[int]]) -> None:
    # The KV landed but vLLM's hand-over did not come with it: the decode engine must not guess, it computes.
    a, b = engines
    p = [5, *prompts[1]]  # shifted: none of it is in b's prefix cache
    want, _ = await _run(a, _req("nohand-ref", p))
    first, _ = await _run(a, _req("nohand-p", p, Phase.PREFILL))
    b.put_kv("nohand", a.take_kv("nohand-p") or b"")
    computed0 = b.stats().prompt_tokens_computed
    rest, _ = await _run(b, _req("nohand", p, Phase.DECODE, first=first))
    assert first + rest == want
    assert b.stats().prompt_tokens_computed - computed0 == len(p) + 1


async def test_first_token_that_ends_the_request_adds_nothing(engines: tuple[VllmEngine, VllmEngine],
                                                              prompts: list[list[int]]) -> None:
    a, b = engines
    first, pout = await _run(a, _req("one-p", prompts[0], Phase.PREFILL, max_tokens=1))
    assert pout.finish_reason == "length"
    b.put_kv("one", a.take_kv("one-p") or b"")
    rest, dout = await _run(b, _req("one", prompts[0], Phase.DECODE, first=first, max_tokens=1,
                                    handover=pout.kv_transfer_params))
    assert rest == [] and dout.completion_tokens == 1


async def test_kv_events_carry_the_gateways_block_hashes(engines: tuple[VllmEngine, VllmEngine],
                                                         prompts: list[list[int]]) -> None:
    a, _ = engines
    await _run(a, _req("events-warm", prompts[0], max_tokens=1))
    a.kv_events()  # drain: prompts[0]'s blocks are cached now
    # A new prompt whose first block is cached: only blocks 1 and 2 are stored, and their mesh hashes
    # chain through the cached parent's, exactly as the gateway hashes the whole prompt.
    p = prompts[0][:BLOCK] + [(7 * i) % 1000 + 2 for i in range(2 * BLOCK + 5)]
    want = block_hashes(MODEL, p, BLOCK)
    await _run(a, _req("events", p, max_tokens=2))
    stored: list[int] = []
    for _ in range(200):
        stored += a.kv_events().stored
        if set(want[1:]) <= set(stored):
            break
        await asyncio.sleep(0.05)
    assert set(want[1:]) <= set(stored)
    assert want[0] not in stored  # already cached: no new event
    assert a.stats().kv_blocks_cached >= len(want)


async def test_prefix_cache_hit_is_reported(engines: tuple[VllmEngine, VllmEngine],
                                            prompts: list[list[int]]) -> None:
    a, _ = engines
    await _run(a, _req("warm", prompts[0], max_tokens=1))
    _, last = await _run(a, _req("hit", prompts[0], max_tokens=1))
    assert last.cached_tokens == len(prompts[0]) // BLOCK * BLOCK


async def test_abort_frees_the_engines_blocks(engines: tuple[VllmEngine, VllmEngine],
                                              prompts: list[list[int]]) -> None:
    a, _ = engines
    req = _req("abort-me", prompts[2], max_tokens=600)
    await a.submit(req)
    got = 0
    async for out in a.stream(req.request_id):
        got += len(out.token_ids)
        if got >= 4 and a.stats().kv_blocks_used > 0:
            assert a.stats().running == 1
            await a.abort(req.request_id)
        if out.finished:
            assert out.finish_reason == "abort"
            break
    assert got < 600
    for _ in range(200):  # the stat logger reports the engine's next view
        if not (a.stats().kv_blocks_used or a.stats().running):
            break
        await asyncio.sleep(0.05)
    s = a.stats()
    assert s.kv_blocks_used == 0 and s.running == 0, s
    assert a.stats().aborted >= 1


def test_primed_detokenizer_equals_stepping_at_every_cut(tiny_model: Path) -> None:
    """A continuation's prompt may end anywhere in a character (a migration, a decode worker's prompt + first
    token): at every cut of a byte-heavy text, the primed stream gives what stepping every token gives."""
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tok.encode("the mesh 日本語 héllo 🎉 serves ok 日本 ").ids
    unfinished = 0
    for cut in range(1, len(ids)):
        primed = PrimedDecodeStream(ids=ids[:cut], skip_special_tokens=True)
        got = "".join(x for t in ids[cut:] if (x := primed.step(tok, t)) is not None)
        assert got == stepped_text(tok, ids[:cut], ids[cut:]), cut
        unfinished += tok.decode(ids[:cut]).endswith("\ufffd")
    assert unfinished >= 5  # the cases that matter were there: cuts inside a character


async def test_completion_after_a_prompt_ending_mid_character(engines: tuple[VllmEngine, VllmEngine],
                                                              prompts: list[list[int]], tiny_model: Path) -> None:
    """Through vLLM itself: the text of a completion whose prompt ends in half a character is the stepped
    text (the character's end and what follows), not the prompt echoed back."""
    a, _ = engines
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    half = tok.encode("日本").ids[:4]  # 日 and the first byte of 本
    assert tok.decode(half).endswith("\ufffd")
    prompt = prompts[0] + half
    await a.submit(_req("mid-char", prompt))
    outs = [o async for o in a.stream("mid-char")]
    ids = [t for o in outs for t in o.token_ids]
    assert len(ids) == MAX_TOKENS
    assert "".join(o.text for o in outs) == stepped_text(tok, prompt, ids)


async def test_step_log_adds_up(engines: tuple[VllmEngine, VllmEngine], prompts: list[list[int]]) -> None:
    """Each engine step as a StepSample from vLLM's per-iteration details (what the online fit learns from)."""
    a, _ = engines
    await asyncio.sleep(0.2)  # the output handler records a step right after handing its outputs out
    a.step_log()  # the earlier tests' steps
    lens = [5, 9, 12]
    reqs = [_req(f"steps-{i}", p, max_tokens=k) for i, (p, k) in enumerate(zip(prompts, lens, strict=True))]
    got = await asyncio.gather(*(_run(a, r) for r in reqs))
    assert [len(ids) for ids, _ in got] == lens
    await asyncio.sleep(0.2)
    steps = a.step_log()
    assert steps and all(s.seconds > 0 for s in steps)
    # Every token but each request's first comes from a decode step; every prompt token was prefilled or cached
    # (the earlier tests left these prompts' blocks in the prefix cache).
    assert sum(s.n_decode for s in steps) == sum(lens) - len(lens)
    assert sum(s.prefill_tokens + s.prefill_cached for s in steps) == sum(len(p) for p in prompts)
    assert sum(s.prefill_seqs for s in steps) >= len(prompts)
    # Each decode step reads the whole context so far: prompt + tokens before the one it computes.
    want = sum(len(p) + j for p, k in zip(prompts, lens, strict=True) for j in range(1, k))
    assert sum(s.decode_context for s in steps) == want
    assert a.step_log() == []  # drained
