"""The sim engine on its own: batching, determinism, prefix cache, abort, disaggregated phases."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from hetmesh.batching import Settings, Step
from hetmesh.costmodel import CostModel, accelerator, model_spec
from hetmesh.engines.base import EngineError, EngineOutput, EngineRequest
from hetmesh.engines.sampling import Completion, expected_completion
from hetmesh.engines.simulated import SimEngine
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import Phase, SamplingParams
from hetmesh.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
BS = 16


class RecordingTimer:
    """The real cost model, with every step's shape written down."""

    def __init__(self) -> None:
        self.cm = CostModel(accelerator("nvidia-h100"), model_spec("tiny-llama"))
        self.steps: list[tuple[list[tuple[int, int]], list[int]]] = []
        self.engine: SimEngine | None = None
        self.free_blocks: list[int] = []  # the engine's free KV blocks at each step

    def step_seconds(self, step: Step) -> float:
        assert self.engine is not None
        core = self.engine.core
        prefills = [(n, c) for _, n, c in step.prefills]
        contexts = [s.prompt_len + core.generated(s) for s in step.decodes or ()]
        assert sum(contexts) == step.decode_context and len(contexts) == step.n_decode
        self.steps.append((prefills, contexts))
        self.free_blocks.append(core.cache.free)
        return self.cm.step_seconds(step)


@pytest.fixture
async def make() -> AsyncIterator:  # type: ignore[type-arg]
    engines: list[SimEngine] = []

    async def _make(time_scale: float = 1e6, **cfg: object) -> tuple[SimEngine, RecordingTimer]:
        timer = RecordingTimer()
        e = SimEngine(TOK, timer, Settings(**cfg), time_scale=time_scale)  # type: ignore[arg-type]
        timer.engine = e
        await e.start()
        engines.append(e)
        return e, timer

    yield _make
    for e in engines:
        await e.close()


def req(rid: str, prompt: str | list[int], max_tokens: int = 20, phase: Phase = Phase.FULL,
        first: list[int] | None = None, **sampling: object) -> EngineRequest:
    toks = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    return EngineRequest(request_id=rid, prompt_tokens=toks, block_hashes=block_hashes("m", toks, BS),
                         sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
                         phase=phase, first_token_ids=first or [])


async def run(e: SimEngine, r: EngineRequest) -> list[EngineOutput]:
    await e.submit(r)
    return [o async for o in e.stream(r.request_id)]


def joined(outs: list[EngineOutput]) -> tuple[list[int], str]:
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


def expect(r: EngineRequest) -> tuple[list[int], str, str]:
    return expected_completion(TOK, r.prompt_tokens, r.sampling)


# ------------------------------------------------------------------ determinism and sampling

def test_generation_is_a_function_of_prompt_and_seed() -> None:
    p = TOK.encode("hello there")
    sp = SamplingParams(max_tokens=50, seed=1, ignore_eos=True)
    a = expected_completion(TOK, p, sp)
    assert a == expected_completion(TOK, p, sp)
    assert a != expected_completion(TOK, p, SamplingParams(max_tokens=50, seed=2, ignore_eos=True))
    assert a != expected_completion(TOK, TOK.encode("hello therf"), sp)
    greedy = [expected_completion(TOK, p, SamplingParams(max_tokens=50, temperature=0, seed=s, ignore_eos=True))
              for s in (1, 2, None)]
    assert greedy[0] == greedy[1] == greedy[2]  # temperature 0: the seed does not matter
    vocab = set(TOK.generation_vocab())
    assert set(a[0]) <= vocab and len(a[0]) == 50 and a[2] == "length" and a[1] == TOK.decode(a[0])


def test_eos_ends_with_stop_unless_ignored() -> None:
    # Find a prompt whose deterministic stream hits EOS early (EOS_PROB ~ 1/512 per token).
    for i in range(2000):
        p = TOK.encode(f"prompt {i}")
        ids, text, finish = expected_completion(TOK, p, SamplingParams(max_tokens=300))
        if finish == "stop":
            break
    else:
        pytest.fail("no EOS within 300 tokens for 2000 prompts")
    assert ids[-1] == TOK.eos_id and text == TOK.decode(ids[:-1])
    ids2, text2, finish2 = expected_completion(TOK, p, SamplingParams(max_tokens=300, ignore_eos=True))
    assert finish2 == "length" and len(ids2) == 300 and TOK.eos_id not in ids2
    assert text2.startswith(text)  # ignore_eos does not reshuffle the rest of the stream


def test_stop_strings_are_cut_and_held_back() -> None:
    sp = SamplingParams(max_tokens=80, seed=4, ignore_eos=True)
    _, full, _ = expected_completion(TOK, TOK.encode("abc"), sp)
    stop = full[30:34]
    sp_stop = SamplingParams(max_tokens=80, seed=4, ignore_eos=True, stop=["zzzzzz", stop])
    ids, text, finish = expected_completion(TOK, TOK.encode("abc"), sp_stop)
    assert finish == "stop" and text == full[: full.index(stop)]
    # Streaming the same tokens one by one never shows any part of the stop string.
    c = Completion(TOK, sp_stop)
    shown = ""
    for t in ids:
        shown += c.append(t)
        assert stop not in shown
    assert shown == text


# ------------------------------------------------------------------ the engine's output

async def test_engine_output_matches_expected_completion(make) -> None:  # type: ignore[no-untyped-def]
    e, _ = await make()
    probe = req("p", "the quick brown fox", 60, seed=9, ignore_eos=True)
    stop = expect(probe)[1][25:28]
    cases = [probe, req("a", "jumps over", 33, seed=1), req("b", "the lazy dog", 60, seed=9, stop=[stop]),
             req("c", "greedy", 17, temperature=0)]
    results = await asyncio.gather(*(run(e, r) for r in cases))
    for r, outs in zip(cases, results, strict=True):
        ids, text, finish = expect(r)
        assert joined(outs) == (ids, text)
        assert outs[-1].finished and outs[-1].finish_reason == finish
        assert outs[-1].completion_tokens == len(ids) and outs[-1].prompt_tokens == len(r.prompt_tokens)
        assert [o.index for o in outs] == [sum(len(x.token_ids) for x in outs[:k]) for k in range(len(outs))]


async def test_continuous_batching_bounded_by_max_batch(make) -> None:  # type: ignore[no-untyped-def]
    e, timer = await make(max_batch=4)
    rs = [req(f"r{i}", f"request number {i}", 10 + 5 * i, ignore_eos=True) for i in range(10)]
    outs = await asyncio.gather(*(run(e, r) for r in rs))
    for r, o in zip(rs, outs, strict=True):
        assert joined(o)[0] == expect(r)[0]
    in_step = [len(p) + len(d) for p, d in timer.steps]
    assert max(in_step) == 4  # full batches, never more
    # Continuous: a step that mixes a newcomer's prefill with others' decodes.
    assert any(p and d for p, d in timer.steps)
    assert e.stats().running == 0 and e.stats().waiting == 0


async def test_long_prompt_prefills_in_chunks(make) -> None:  # type: ignore[no-untyped-def]
    e, timer = await make(step_tokens=2048, kv_blocks=1024)
    prompt = [ord("a") + i % 26 for i in range(5000)]
    outs = await run(e, req("long", prompt, 3))
    assert joined(outs)[0] == expect(req("long", prompt, 3))[0]
    prefills = [p for p, _ in timer.steps if p]
    assert prefills == [[(2048, 0)], [(2048, 2048)], [(904, 4096)]]  # (new, cached-before) chunks
    assert [d for _, d in timer.steps if d] == [[5001], [5002]]


async def test_kv_capacity_bounds_the_batch_and_preempts(make) -> None:  # type: ignore[no-untyped-def]
    # A 40-token prompt is admitted with ceil(41 / 16) = 3 blocks and grows to 5 by its 80th token:
    # 12 blocks admit four, then growth preempts the newest, which later recomputes and continues.
    e, timer = await make(kv_blocks=12, max_batch=64)
    rs = [req(f"k{i}", str(i) + "x" * 39, 40, ignore_eos=True) for i in range(5)]  # no shared blocks
    outs = await asyncio.gather(*(run(e, r) for r in rs))
    for r, o in zip(rs, outs, strict=True):
        assert joined(o) == expect(r)[:2]  # preemption changes the timing, never the text
        assert [x.index for x in o] == [sum(len(y.token_ids) for y in o[:k]) for k in range(len(o))]
    assert max(len(p) + len(d) for p, d in timer.steps) == 4
    assert min(timer.free_blocks) >= 0
    assert e.stats().preempted > 0
    # A preempted request recomputes its prompt *and* the tokens it had generated.
    assert any(new + cached > 41 for p, _ in timer.steps for new, cached in p)
    assert e.stats().kv_blocks_used == 0
    with pytest.raises(EngineError):
        await e.submit(req("huge", "y" * 200, 10))  # could never finish alone in 12 blocks


# ------------------------------------------------------------------ prefix cache

async def test_prefix_cache_hits_report_cached_tokens(make) -> None:  # type: ignore[no-untyped-def]
    e, timer = await make()
    shared = "S" * (BS * 5)
    first = await run(e, req("a", shared + "tail one", 3))
    assert first[-1].cached_tokens == 0
    stored = e.kv_events()
    assert stored.cleared and set(block_hashes("m", TOK.encode(shared + "tail one"), BS)) <= set(stored.stored)
    second = await run(e, req("b", shared + "tail two", 3))
    assert second[-1].cached_tokens == 5 * BS
    assert [p for p, _ in timer.steps if p][-1] == [(len(shared + "tail two") - 5 * BS, 5 * BS)]
    # A prompt that is all cached still computes its last token (its logits give the first token).
    exact = await run(e, req("c", shared, 3))
    assert exact[-1].cached_tokens == 5 * BS - 1
    s = e.stats()
    assert s.prompt_tokens_cached == 5 * BS + 5 * BS - 1
    assert joined(second)[0] == expect(req("b", shared + "tail two", 3))[0]  # cache hits do not change text


async def test_lru_eviction_emits_removed_events(make) -> None:  # type: ignore[no-untyped-def]
    e, _ = await make(kv_blocks=20)
    pa, pb, pc = ("A" * (BS * 8), "B" * (BS * 8), "C" * (BS * 8))
    ha, hb, hc = (block_hashes("m", TOK.encode(p), BS) for p in (pa, pb, pc))
    await run(e, req("a", pa, 1))
    await run(e, req("b", pb, 1))
    assert e.stats().kv_blocks_cached == 16
    assert (await run(e, req("a2", pa, 1)))[-1].cached_tokens == 8 * BS - 1  # touch A: B is now least recent
    e.kv_events()
    await run(e, req("c", pc, 1))  # needs 9 blocks, 4 free: evicts B's, keeps A's
    ev = e.kv_events()
    assert set(ev.stored) == set(hc) and set(ev.removed) <= set(hb) and len(ev.removed) == 5
    assert not set(ev.removed) & set(ha)
    assert (await run(e, req("a3", pa, 1)))[-1].cached_tokens == 8 * BS - 1
    # B's leading blocks were the first evicted: nothing of B is a usable prefix any more.
    assert (await run(e, req("b2", pb, 1)))[-1].cached_tokens == 0


async def test_making_room_never_evicts_the_prefix_being_hit(make) -> None:  # type: ignore[no-untyped-def]
    e, _ = await make(kv_blocks=12)
    pa, pb = "A" * (BS * 8), "B" * (BS * 3)
    await run(e, req("a", pa, 1))
    await run(e, req("b", pb, 1))  # 11 cached blocks, 1 free; A's are the least recently used
    e.kv_events()
    out = await run(e, req("a2", pa + "z" * 40, 1))  # hits A's 8 blocks, needs 3 more: evicts B's, not A's
    assert out[-1].cached_tokens == 8 * BS
    assert set(e.kv_events().removed) <= set(block_hashes("m", TOK.encode(pb), BS))


# ------------------------------------------------------------------ abort

async def test_abort_stops_the_work(make) -> None:  # type: ignore[no-untyped-def]
    e, timer = await make(time_scale=1.0)  # real-time steps, so the request is still running when aborted
    r = req("long", "never finish", 5000, ignore_eos=True)
    await e.submit(r)
    waiting = req("queued", "behind it", 5)
    stream = e.stream("long")
    first = await anext(stream)
    assert first.token_ids and not first.finished
    assert await e.abort("long")
    rest = [o async for o in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    steps, generated = len(timer.steps), e.stats().tokens_generated
    assert generated < 5000
    await asyncio.sleep(0.05)  # a few simulated steps' worth of wall time
    assert len(timer.steps) == steps and e.stats().tokens_generated == generated  # nothing more was computed
    assert e.stats().running == 0 and e.stats().kv_blocks_used == 0 and e.stats().aborted == 1
    assert not await e.abort("long")
    # Aborting a request that is still waiting also ends its stream.
    e2, _ = await make(max_batch=1, time_scale=1.0)
    await e2.submit(req("busy", "occupy the only slot", 5000, ignore_eos=True))
    await e2.submit(waiting)
    assert await e2.abort("queued")
    outs = [o async for o in e2.stream("queued")]
    assert outs == [outs[-1]] and outs[-1].finish_reason == "abort" and not outs[-1].token_ids


# ------------------------------------------------------------------ disaggregated phases

@pytest.mark.parametrize("max_tokens,stop", [(30, []), (1, []), (40, ["@@"]), (60, None)])
async def test_prefill_then_decode_equals_full(make, max_tokens: int, stop: list[str] | None) -> None:  # type: ignore[no-untyped-def]
    e_p, _ = await make()
    e_d, timer_d = await make()
    prompt = "split me across two workers " * 4
    base = req("x", prompt, max_tokens, seed=2)
    if stop is None:  # a stop string that begins right after the first token
        stop = [expect(req("x", prompt, max_tokens, seed=2, ignore_eos=True))[1][1:4]]
    full = req("x", prompt, max_tokens, seed=2, stop=stop)
    ids, text, finish = expect(full)
    pre = await run(e_p, req("x", prompt, max_tokens, Phase.PREFILL, seed=2, stop=stop))
    assert len(pre) == 1 and pre[0].finished and pre[0].token_ids == ids[:1]
    assert pre[0].finish_reason == (finish if len(ids) == 1 else None)
    dec = await run(e_d, req("x", prompt, max_tokens, Phase.DECODE, first=pre[0].token_ids, seed=2, stop=stop))
    assert dec[0].index == 1 and dec[-1].finish_reason == finish
    assert pre[0].token_ids + joined(dec)[0] == ids
    assert pre[0].text + joined(dec)[1] == text
    assert dec[-1].completion_tokens == len(ids)
    assert all(not p for p, _ in timer_d.steps)  # decode never recomputes the prompt
    assert base.prompt_tokens == full.prompt_tokens


class FailingTimer(RecordingTimer):
    """The real cost model until step `fail_at`, then an exception: a broken engine step."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def step_seconds(self, step: Step) -> float:
        if len(self.steps) >= self.fail_at:
            raise RuntimeError("accelerator fell off the bus")
        return super().step_seconds(step)


async def test_a_failing_engine_ends_every_stream_with_error() -> None:
    timer = FailingTimer(fail_at=5)
    e = SimEngine(TOK, timer, time_scale=1e6)
    timer.engine = e
    await e.start()
    try:
        await e.submit(req("a", "one", 100, ignore_eos=True))
        await e.submit(req("b", "two", 100, ignore_eos=True))
        outs = await asyncio.wait_for(asyncio.gather(*(_collect(e, rid) for rid in ("a", "b"))), 10)
        for o in outs:
            assert o[-1].finished and o[-1].finish_reason == "error" and o[-1].completion_tokens < 100
        with pytest.raises(EngineError, match="accelerator fell off"):
            await e.submit(req("c", "three", 5))
    finally:
        await e.close()


async def _collect(e: SimEngine, rid: str) -> list[EngineOutput]:
    return [o async for o in e.stream(rid)]
