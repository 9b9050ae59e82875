"""Migration's pure parts: the sim engine continuing a completion after k of its tokens (the same text as
an undisturbed run), and the worker's cancel bookkeeping (what a Cancel stops, and KV for a cancelled
request). The gateway's side of a migration is in test_reply_stream.py."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.batching import Settings
from hetmesh.costmodel import CostModel, accelerator, model_spec
from hetmesh.engines.base import EngineOutput, EngineRequest
from hetmesh.engines.sampling import expected_completion
from hetmesh.engines.simulated import SimEngine
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import InferenceRequest, KvLanded, Phase, Placement, SamplingParams, WorkItem
from hetmesh.tokenizer import ByteTokenizer
from hetmesh.worker.kv import KvInbox, request_of, transfer_id
from hetmesh.worker.requests import RequestBook, Stop

TOK = ByteTokenizer()


async def run(engine: SimEngine, er: EngineRequest) -> list[EngineOutput]:
    await engine.submit(er)
    return [o async for o in engine.stream(er.request_id)]


def continued(rid: str, prompt: list[int], done: list[int], sampling: SamplingParams,
              phase: Phase = Phase.FULL, first: list[int] | None = None) -> EngineRequest:
    """What the gateway re-submits after `done` tokens: prompt + done, max_tokens less them."""
    full = prompt + done
    return EngineRequest(request_id=rid, prompt_tokens=full, block_hashes=block_hashes("m", full, 16),
                         sampling=msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(done)),
                         phase=phase, first_token_ids=first or [], continued=len(done))


@settings(max_examples=25, deadline=None)
@given(prompt=st.text(min_size=1, max_size=40), n=st.integers(2, 40), cut=st.integers(1, 39),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 5),
       stop=st.sampled_from([[], ["e"], ["ab", "zz"]]), ignore_eos=st.booleans())
async def test_a_continued_completion_is_the_undisturbed_one(prompt: str, n: int, cut: int, temperature: float,
                                                              seed: int, stop: list[str], ignore_eos: bool) -> None:
    """Aggregated (FULL) and split (PREFILL's first token, then DECODE) continuations after `cut` tokens
    give exactly the undisturbed run's remaining tokens and text, numbered from `cut`, with the whole
    completion's usage."""
    sampling = SamplingParams(max_tokens=n, temperature=temperature, seed=seed, stop=stop, ignore_eos=ignore_eos)
    p = TOK.encode(prompt)
    ids, text, reason = expected_completion(TOK, p, sampling)
    if cut >= len(ids):
        return  # it ended before the cut: nothing to migrate
    # What the client got before the loss: the text the engine emitted for the first `cut` tokens.
    e = SimEngine(TOK, CostModel(accelerator("nvidia-h100"), model_spec("tiny-llama")), Settings(), time_scale=1e6)
    await e.start()
    try:
        whole = await run(e, continued("w", p, [], sampling))
        before = "".join(o.text for o in whole if o.index < cut and o.index + len(o.token_ids) <= cut)
        assert "".join(o.text for o in whole) == text
        outs = await run(e, continued("a", p, ids[:cut], sampling))
        assert outs[0].index == cut
        assert [t for o in outs for t in o.token_ids] == ids[cut:]
        assert outs[-1].finish_reason == reason
        assert outs[-1].completion_tokens == len(ids) and outs[-1].prompt_tokens == len(p)
        if all(len(o.token_ids) == 1 for o in whole):  # one token per output: the cut falls between outputs
            assert before + "".join(o.text for o in outs) == text
        pre = await run(e, continued("d", p, ids[:cut], sampling, Phase.PREFILL))
        assert pre[-1].index == cut and pre[-1].token_ids == ids[cut:cut + 1]
        if pre[-1].finish_reason is None:
            dec = await run(e, continued("d", p, ids[:cut], sampling, Phase.DECODE, first=pre[-1].token_ids))
            assert dec[0].index == cut + 1
            assert [t for o in dec for t in o.token_ids] == ids[cut + 1:]
            assert dec[-1].finish_reason == reason and dec[-1].completion_tokens == len(ids)
    finally:
        await e.close()


def item(rid: str, phase: Phase) -> WorkItem:
    req = InferenceRequest(request_id=rid, model="m", prompt_tokens=[1, 2], block_hashes=[],
                           sampling=SamplingParams(max_tokens=4), reply_subject="r", arrival_ts=0.0)
    return WorkItem(request=req, phase=phase, placement=Placement(mode="disaggregated", decode_worker="d"))


def test_cancel_says_how_to_stop_each_phase_and_remembers_the_id() -> None:
    book: RequestBook[str] = RequestBook("m")
    book.accept(item("f", Phase.FULL), 0.0, "hf")
    pre, _ = book.accept(item("p", Phase.PREFILL), 0.0, "hp")
    book.accept(item("d", Phase.DECODE), 0.0, "hd")
    pre.shipping = True
    assert book.cancel("f", 1.0) == Stop.ENGINE
    assert book.cancel("p", 1.0) == Stop.SHIPPING
    assert book.cancel("d", 1.0) == Stop.KV_WAIT
    assert book.cancel("x", 1.0) == Stop.NONE  # not here (yet)
    assert all(book.was_cancelled(r) for r in "fpdx") and not book.was_cancelled("y")
    book.sweep(1.0 + book.stale_s + 1)
    assert not book.was_cancelled("f")


def test_a_drain_out_of_time_hands_every_request_over_by_its_phase() -> None:
    book: RequestBook[str] = RequestBook("m")
    book.accept(item("f", Phase.FULL), 0.0, "hf")
    pre, _ = book.accept(item("p", Phase.PREFILL), 0.0, "hp")
    book.accept(item("d", Phase.DECODE), 0.0, "hd")
    pre.shipping = True
    assert {r.request_id: how for r, how in book.hand_over()} == {"f": Stop.ENGINE, "p": Stop.SHIPPING,
                                                                  "d": Stop.KV_WAIT}


def test_a_cancel_drops_the_kv_that_landed_for_it_and_only_that() -> None:
    inbox: KvInbox[str] = KvInbox(keep_bytes=False)
    a, b = transfer_id("gw1-7", "abc"), transfer_id("gw1-70", "def")
    assert request_of(a) == "gw1-7"
    inbox.streamed(a, 10, "sink-a", 0.0)
    inbox.streamed(b, 10, "sink-b", 0.0)
    assert inbox.cancel("gw1-7") == ["sink-a"]
    assert len(inbox) == 1 and inbox.cancel("gw1-7") == []
    claim = inbox.claim(KvLanded(transfer_id=b, request_id="gw1-70", src_worker="p", nbytes=10, chunks=1,
                                 duration_s=0.0, first_token_ids=[1], direct=True))
    assert claim.sink == "sink-b"


def test_a_cancelled_request_forgets_its_early_kv_landed() -> None:
    book: RequestBook[str] = RequestBook("m")
    landed = KvLanded(transfer_id="t", request_id="d", src_worker="p", nbytes=1, chunks=1, duration_s=0.0,
                      first_token_ids=[1])
    assert book.landed(landed, 0.0) is None  # kept for a WorkItem on its way
    book.cancel("d", 0.1)
    r, early = book.accept(item("d", Phase.DECODE), 0.2, "h")
    assert early is None and r.waiting_for_kv
