"""The worker's pure state (hetmesh.worker.requests, hetmesh.worker.kv): no NATS, no event loop."""

from __future__ import annotations

from hetmesh.engines.base import EngineOutput
from hetmesh.protocol import InferenceRequest, KvLanded, Phase, Placement, SamplingParams, WorkItem
from hetmesh.worker.kv import CacheMirror, KvInbox, chunk_size, direct_endpoint, transfer_request, wire_bytes
from hetmesh.worker.requests import RequestBook, Stop, Verdict

MODEL = "tiny"


def item(rid: str = "r1", phase: Phase = Phase.FULL, attempt: int = 0, model: str = MODEL,
         kv_endpoint: str = "") -> WorkItem:
    req = InferenceRequest(request_id=rid, model=model, prompt_tokens=[1, 2, 3], block_hashes=[],
                           sampling=SamplingParams(max_tokens=4), reply_subject=f"reply.{rid}", arrival_ts=0.0,
                           attempt=attempt)
    mode = "aggregated" if phase == Phase.FULL else "disaggregated"
    return WorkItem(request=req, phase=phase, placement=Placement(
        mode=mode, decode_worker="dec-0", prefill_worker=None if phase == Phase.FULL else "pre-0",
        decode_kv_endpoint=kv_endpoint))


def landed(rid: str = "r1", tid: str = "r1.t", nbytes: int = 10, chunks: int = 1, ok: bool = True,
           direct: bool = False) -> KvLanded:
    return KvLanded(transfer_id=tid, request_id=rid, src_worker="pre-0", nbytes=nbytes, chunks=chunks,
                    duration_s=0.01, first_token_ids=[7], ok=ok, direct=direct)


class Handle:
    """Stands in for the service's task and future."""


# ---------------------------------------------------------------------- RequestBook: intake
def test_fresh_item_is_accepted_and_held() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    it = item()
    assert book.verdict(it) == Verdict.ACCEPT
    h = Handle()
    r, early = book.accept(it, 5.0, h)
    assert early is None and book.get("r1") is r
    assert r.handle is h and r.received == 5.0 and not r.waiting_for_kv and r.attempt == 0
    assert "r1" in book and len(book) == 1


def test_same_or_older_attempt_is_a_duplicate_newer_supersedes() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    book.accept(item(attempt=1), 0.0, Handle())
    assert book.verdict(item(attempt=1)) == Verdict.DUPLICATE
    assert book.verdict(item(attempt=0)) == Verdict.DUPLICATE
    assert book.verdict(item(attempt=2)) == Verdict.SUPERSEDE


def test_draining_refuses_everything_first() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    book.accept(item(), 0.0, Handle())
    book.draining = True
    assert book.verdict(item(attempt=3)) == Verdict.DRAINING
    assert book.verdict(item("other", model="another")) == Verdict.DRAINING


def test_other_model_is_misrouted() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    assert book.verdict(item(model="another")) == Verdict.MISROUTED


def test_cancel_that_beat_its_item_is_used_up_once() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    assert book.cancel("r1", 0.0) == Stop.NONE
    assert book.verdict(item()) == Verdict.CANCELLED
    assert book.verdict(item()) == Verdict.ACCEPT  # a later copy is not cancelled again


def test_supersede_marks_the_old_attempt_and_says_how_to_stop_it() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    book.accept(item(phase=Phase.DECODE), 0.0, Handle())
    assert book.supersede("r1") == Stop.KV_WAIT  # nothing in the engine yet
    r = book.get("r1")
    assert r is not None and r.superseded and not r.cancelled
    book.accept(item("r2"), 0.0, Handle())
    assert book.supersede("r2") == Stop.ENGINE
    assert book.supersede("nobody") == Stop.NONE


def test_finish_by_an_old_task_leaves_the_new_attempt_alone() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    old, new = Handle(), Handle()
    book.accept(item(), 0.0, old)
    assert book.finish("r1", old)
    book.accept(item(attempt=1), 1.0, new)
    assert not book.finish("r1", old)
    r = book.get("r1")
    assert r is not None and r.handle is new
    assert book.finish("r1", new) and "r1" not in book


# ---------------------------------------------------------------------- RequestBook: cancel
def test_cancel_of_a_decode_waiting_for_kv_stops_the_wait_else_the_engine() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    book.accept(item("d", Phase.DECODE), 0.0, Handle())
    book.accept(item("f"), 0.0, Handle())
    assert book.cancel("d", 1.0) == Stop.KV_WAIT
    assert book.cancel("f", 1.0) == Stop.ENGINE
    assert all(r.cancelled for r in book.live())
    book.landed(landed("d"), 2.0)  # landed after all: the decode is in the engine's hands next
    assert book.cancel("d", 3.0) == Stop.ENGINE


def test_a_cancel_naming_a_phase_stops_only_that_item() -> None:
    """A withdrawn P/D placement's Cancels (Cancel.phase, attempt): the same worker may hold another placement's
    FULL of the request, which goes on; the prefill they name stops, here or when it comes."""
    book: RequestBook[Handle] = RequestBook(MODEL)
    book.accept(item(), 0.0, Handle())  # the FULL
    assert book.cancel("r1", 1.0, Phase.PREFILL, 0) == Stop.NONE
    assert book.cancel("r1", 1.0, Phase.FULL, 1) == Stop.NONE  # another attempt's
    full = book.get("r1")
    assert full is not None and not full.cancelled and not book.was_cancelled("r1")
    assert book.cancel("r1", 1.0, Phase.FULL, 0) == Stop.ENGINE and full.cancelled  # its own phase and attempt
    # A prefill that is held stops; one whose Cancel came first is cancelled on arrival, once, that attempt only.
    book.accept(item("p", Phase.PREFILL), 0.0, Handle())
    assert book.cancel("p", 1.0, Phase.PREFILL, 0) == Stop.ENGINE
    assert book.cancel("q", 1.0, Phase.PREFILL, 2) == Stop.NONE
    assert book.verdict(item("q", Phase.PREFILL, attempt=1)) == Verdict.ACCEPT
    assert book.verdict(item("q", Phase.FULL, attempt=2)) == Verdict.ACCEPT
    assert book.verdict(item("q", Phase.PREFILL, attempt=2)) == Verdict.CANCELLED
    assert book.verdict(item("q", Phase.PREFILL, attempt=2)) == Verdict.ACCEPT
    book.sweep(1.0 + book.stale_s + 1)  # a remembered one whose item never came is forgotten
    assert book.cancel("s", 0.0, Phase.PREFILL, 0) == Stop.NONE
    book.sweep(book.stale_s + 1)
    assert book.verdict(item("s", Phase.PREFILL)) == Verdict.ACCEPT


def test_a_decode_cancel_for_a_decode_not_held_refuses_its_kv() -> None:
    """The decode half of a withdrawn placement never comes (the stream dropped it as a duplicate): KV its
    prefill shipped before its own Cancel landed is refused or dropped, unless a decode here waits for KV."""
    book: RequestBook[Handle] = RequestBook(MODEL)
    book.landed(landed("o"), 0.0)  # orphan KV, kept for a DECODE that might still come
    assert book.cancel("o", 1.0, Phase.DECODE, 0) == Stop.NONE and book.was_cancelled("o")
    assert book.verdict(item("o", Phase.DECODE)) == Verdict.CANCELLED
    book.accept(item("f"), 0.0, Handle())  # the other placement's FULL on this very worker
    assert book.cancel("f", 1.0, Phase.DECODE, 0) == Stop.NONE and book.was_cancelled("f")
    f = book.get("f")
    assert f is not None and not f.cancelled
    book.accept(item("d", Phase.DECODE, attempt=1), 0.0, Handle())  # a newer attempt waiting for its own KV
    assert book.cancel("d", 1.0, Phase.DECODE, 0) == Stop.NONE and not book.was_cancelled("d")
    assert book.landed(landed("d"), 2.0) is book.get("d")


# ---------------------------------------------------------------------- RequestBook: the KV wait
def test_landed_wakes_the_waiting_decode_once() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    h = Handle()
    book.accept(item(phase=Phase.DECODE), 0.0, h)
    assert book.kv_waiting == 1 and [r.handle for r in book.waiting()] == [h]
    r = book.landed(landed(), 1.0)
    assert r is not None and r.handle is h and not r.waiting_for_kv
    assert book.kv_waiting == 0 and book.waiting() == []
    # A second KvLanded (e.g. the relay's after a local fallback) wakes nobody; it is kept, not lost.
    assert book.landed(landed(), 2.0) is None


def test_landed_before_the_item_is_handed_to_it_at_accept() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    early = landed()
    assert book.landed(early, 0.0) is None
    r, got = book.accept(item(phase=Phase.DECODE), 1.0, Handle())
    assert got is early and not r.waiting_for_kv and book.kv_waiting == 0


def test_compute_items_never_wait_for_kv() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    book.landed(landed(), 0.0)
    assert book.accept(item(phase=Phase.PREFILL), 1.0, Handle())[1] is None
    assert book.kv_waiting == 0


def test_kv_wait_count_follows_timeouts_and_finishes() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL)
    ha, hb = Handle(), Handle()
    book.accept(item("a", Phase.DECODE), 0.0, ha)
    book.accept(item("b", Phase.DECODE), 0.0, hb)
    assert book.kv_waiting == 2
    a = book.get("a")
    assert a is not None
    book.kv_wait_over(a)  # timed out
    book.kv_wait_over(a)  # twice is harmless
    assert book.kv_waiting == 1
    book.finish("b", hb)  # ended (e.g. cancelled) while waiting
    assert book.kv_waiting == 0


def test_early_messages_are_bounded_and_go_stale() -> None:
    book: RequestBook[Handle] = RequestBook(MODEL, early_max=2, stale_s=10.0)
    for i in range(3):
        book.landed(landed(f"r{i}"), float(i))
    # r0, the oldest, made room for r2
    assert book.accept(item("r0", Phase.DECODE), 3.0, Handle())[1] is None
    assert book.accept(item("r2", Phase.DECODE), 3.0, Handle())[1] is not None
    book.cancel("c1", 0.0)
    book.cancel("c2", 20.0)
    book.landed(landed("late"), 0.0)
    book.sweep(15.0)
    assert book.verdict(item("c1")) == Verdict.ACCEPT  # forgotten
    assert book.verdict(item("c2")) == Verdict.CANCELLED
    assert book.accept(item("late", Phase.DECODE), 16.0, Handle())[1] is None


# ---------------------------------------------------------------------- KvInbox
class Sink:
    def __init__(self) -> None:
        self.view = None


def test_relay_chunks_are_counted_and_kept_in_order_for_real_kv() -> None:
    inbox: KvInbox[Sink] = KvInbox(keep_bytes=True)
    inbox.chunk("t", b"abc", 0, 1.0)
    inbox.chunk("t", b"de", 1, 1.1)
    assert inbox.bytes_seen("t") == 5 and inbox.bytes_received == 5
    claim = inbox.claim(landed(tid="t", nbytes=5, chunks=2))
    assert claim.problem is None and claim.data == b"abcde" and claim.received == 5
    assert len(inbox) == 0


def test_relay_chunk_out_of_sequence_makes_real_kv_unusable() -> None:
    inbox: KvInbox[Sink] = KvInbox(keep_bytes=True)
    inbox.chunk("t", b"abc", 0, 1.0)
    inbox.chunk("t", b"de", 2, 1.1)  # seq 1 went missing
    claim = inbox.claim(landed(tid="t", nbytes=5, chunks=2))
    assert claim.data is None and claim.problem == "KV arrived incomplete (5 of 5 bytes)"


def test_short_real_kv_is_unusable_simulated_kv_only_counts() -> None:
    real: KvInbox[Sink] = KvInbox(keep_bytes=True)
    real.chunk("t", b"abc", 0, 1.0)
    assert real.claim(landed(tid="t", nbytes=5, chunks=1)).problem == "KV arrived incomplete (3 of 5 bytes)"
    assert real.claim(landed(tid="never", nbytes=5)).problem is not None
    sim: KvInbox[Sink] = KvInbox(keep_bytes=False)
    sim.chunk("t", b"abc", 0, 1.0)
    claim = sim.claim(landed(tid="t", nbytes=5))
    assert claim.problem is None and claim.data is None and claim.received == 3


def test_direct_stream_lands_in_its_sink() -> None:
    inbox: KvInbox[Sink] = KvInbox(keep_bytes=True)
    sink = Sink()
    inbox.streamed("t", 1 << 20, sink, 1.0)
    assert inbox.bytes_seen("t") == 1 << 20 and inbox.bytes_received == 1 << 20
    claim = inbox.claim(landed(tid="t", nbytes=1 << 20, direct=True))
    assert claim.sink is sink and claim.problem is None and claim.received == 1 << 20
    # Claimed once: a second claim finds nothing, which real KV cannot use.
    assert inbox.claim(landed(tid="t", nbytes=1 << 20, direct=True)).problem is not None


def test_local_prefill_claims_nothing() -> None:
    inbox: KvInbox[Sink] = KvInbox(keep_bytes=True)
    claim = inbox.claim(landed(tid="", nbytes=0))
    assert claim.problem is None and claim.sink is None and claim.received == 0


def test_unclaimed_kv_is_swept_and_its_sinks_returned() -> None:
    inbox: KvInbox[Sink] = KvInbox(keep_bytes=False, stale_s=10.0)
    old, fresh = Sink(), Sink()
    inbox.streamed("old", 1, old, 0.0)
    inbox.streamed("fresh", 1, fresh, 8.0)
    inbox.chunk("relay", b"x", 0, 0.0)
    assert inbox.sweep(12.0) == [old]
    assert len(inbox) == 1
    assert inbox.drain() == [fresh] and len(inbox) == 0


# ---------------------------------------------------------------------- CacheMirror
def test_cache_mirror_follows_event_batches() -> None:
    c = CacheMirror()
    c.apply([1, 2, 3], [], False)
    c.apply([4], [2], False)
    assert c.held == {1, 3, 4}
    c.apply([5], [], True)  # cleared first, then stored
    assert c.held == {5}


def test_cache_mirror_batches_cover_the_cache_and_an_empty_one_still_clears() -> None:
    c = CacheMirror()
    assert c.batches(2) == [[]]
    c.apply(range(5), [], False)
    parts = c.batches(2)
    assert [len(p) for p in parts] == [2, 2, 1] and sorted(h for p in parts for h in p) == list(range(5))


# ---------------------------------------------------------------------- shipping plans
def test_wire_bytes_and_chunks() -> None:
    assert wire_bytes(100, 10, 0) == 1000
    assert wire_bytes(100, 10, 300) == 300
    assert chunk_size(1 << 20, 1 << 20) == (1 << 20) - 1024  # room for the headers
    assert chunk_size(4096, 1 << 20) == 4096
    assert chunk_size(4096, 100) == 1


def test_endpoint_from_the_placement_only_on_the_direct_plane() -> None:
    p = item(phase=Phase.PREFILL, kv_endpoint="10.0.0.2:7000").placement
    assert direct_endpoint(p, "direct") == "10.0.0.2:7000"
    assert direct_endpoint(p, "nats") == ""
    assert direct_endpoint(item(phase=Phase.PREFILL).placement, "direct") == ""


def test_transfer_request_carries_the_first_tokens_to_the_decode_worker() -> None:
    it = item(phase=Phase.PREFILL)
    out = EngineOutput(request_id="r1", index=0, token_ids=[42], text="x", finished=True, cached_tokens=16)
    t = transfer_request(it, out, "pre-0", "r1.ab", 3000, 1024, "10.0.0.2:7000")
    assert (t.src_worker, t.dst_worker, t.num_tokens, t.nbytes, t.chunk_bytes) == ("pre-0", "dec-0", 3, 3000, 1024)
    assert (t.first_token_ids, t.first_text, t.cached_tokens, t.endpoint) == ([42], "x", 16, "10.0.0.2:7000")
    assert t.transfer_id == "r1.ab" and t.request_id == "r1" and t.model == MODEL


def test_vllms_handover_travels_with_the_transfer_and_a_bytes_free_one_is_claimable() -> None:
    # vLLM's kv_transfer_params from the prefill output reach the decode worker's KvLanded unchanged ...
    handover = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [3, 4]}
    out = EngineOutput(request_id="r1", index=0, token_ids=[42], text="x", finished=True,
                       kv_transfer_params=handover)
    t = transfer_request(item(phase=Phase.PREFILL), out, "pre-0", "r1.ab", 0, 0)
    got = KvLanded.of(t)
    assert t.kv_transfer_params == handover and got.kv_transfer_params == handover
    # ... and with NIXL no bytes come through the mesh: nothing to claim is not "incomplete".
    claim = KvInbox[Sink](keep_bytes=True).claim(got)
    assert claim.problem is None and claim.data is None and claim.received == 0
