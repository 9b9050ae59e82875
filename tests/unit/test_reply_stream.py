"""The gateway's per-request reply stream (hetmesh.gateway.stream.ReplyStream), without a mesh or a clock:
messages and times go in, the actions the gateway would carry out come out."""

from __future__ import annotations

import itertools
import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.gateway.stream import (
    BUS_GAP,
    DISCONNECT_POLL_S,
    POLL_CLIENT,
    RESUME_EVERY_S,
    RESUME_HOLE_S,
    RESUME_IDLE_S,
    RESUME_MAX_S,
    Fail,
    PollClient,
    ReplyStream,
    Retry,
    SendResume,
    Wait,
)
from hetmesh.protocol import ErrorInfo, RequestError, TokenChunk, Usage, WorkerLost, Working

STALL_S = 60.0


def chunk(index: int, text: str, finish: str | None = None, worker: str = "w1") -> TokenChunk:
    """One token per character, so `index` counts characters."""
    return TokenChunk(request_id="r", worker_id=worker, index=index, token_ids=[ord(c) for c in text], text=text,
                      finish_reason=finish)


def split(text: str, sizes: list[int]) -> list[TokenChunk]:
    out, i = [], 0
    for n in sizes:
        if i >= len(text):
            break
        out.append(chunk(i, text[i:i + n]))
        i += n
    out.append(chunk(len(text), "", finish="stop"))
    return out


def feed(s: ReplyStream, *msgs: TokenChunk | RequestError | WorkerLost | object) -> list[Retry | Fail | None]:
    return [s.receive(m) for m in msgs]  # type: ignore[arg-type]


def clocks(s: ReplyStream, now: float) -> list[SendResume | PollClient | Fail | Retry | Wait]:
    """Every action the clocks ask for at `now`, ending with the Wait (or a Fail or Retry), as Call.pull runs them."""
    out: list[SendResume | PollClient | Fail | Retry | Wait] = []
    while True:
        act = s.tick(now)
        out.append(act)
        if isinstance(act, Wait | Fail | Retry):
            return out


def texts(chunks: list[TokenChunk]) -> list[str]:
    return [c.text for c in chunks]


def lost(worker: str = "w1") -> WorkerLost:
    return WorkerLost(request_id="r", worker_id=worker)


def req_error(retryable: bool, code: str = "engine_error") -> RequestError:
    return RequestError(request_id="r", error=ErrorInfo(message="boom", code=code, status=500), retryable=retryable)


# --- order --------------------------------------------------------------------------------------
def test_in_order_chunks_come_out_as_they_arrive() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    assert feed(s, chunk(0, "ab"), chunk(2, "cd")) == [None, None]
    assert texts(s.drained(0.0)) == ["ab", "cd"]
    assert s.drained(0.0) == []  # handed out once
    last = TokenChunk(request_id="r", worker_id="w1", index=4, token_ids=[ord("e")], text="e", finish_reason="length",
                      usage=Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=3))
    assert s.receive(last) is None
    assert texts(s.drained(0.1)) == ["e"]
    assert s.done and s.finish_reason == "length" and s.next_index == 5
    assert s.usage(7) == Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=3)


def test_usage_without_a_usage_chunk_counts_the_tokens() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    feed(s, chunk(0, "abc"), chunk(3, "", finish="stop"))
    s.drained(0.0)
    assert s.usage(4) == Usage(prompt_tokens=4, completion_tokens=3)


def test_duplicates_are_dropped() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    a, b = chunk(0, "ab"), chunk(2, "cd")
    assert feed(s, a, a, b, a, b) == [None] * 5
    assert texts(s.drained(0.0)) == ["ab", "cd"]
    feed(s, b, chunk(4, "", finish="stop"), chunk(4, "late"))  # a duplicate, the end, then nothing more
    assert [c.finish_reason for c in s.drained(0.0)] == ["stop"]
    assert s.done and s.next_index == 4


def test_out_of_order_chunks_wait_for_the_missing_one() -> None:
    # Disaggregated: the decode worker's tokens 1.. can beat the prefill worker's token 0.
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    feed(s, chunk(3, "d", worker="dec"), chunk(1, "bc", worker="dec"))
    assert s.drained(0.0) == []
    assert not s.done
    s.receive(chunk(0, "a", worker="pre"))
    assert texts(s.drained(0.1)) == ["a", "bc", "d"]
    assert s.next_index == 4


@settings(deadline=None)
@given(st.text(alphabet="abcxyz ", min_size=1, max_size=40), st.lists(st.integers(1, 5), min_size=40, max_size=40),
       st.integers(0, 2**32 - 1), st.integers(0, 15), st.booleans())
def test_any_arrival_order_gives_the_text_once_and_never_an_action(text: str, sizes: list[int], seed: int,
                                                                    dups: int, delivered: bool) -> None:
    rnd = random.Random(seed)
    chunks = split(text, sizes)
    arrivals = chunks + [rnd.choice(chunks) for _ in range(dups)]
    rnd.shuffle(arrivals)
    s = ReplyStream(max_attempts=1, stall_timeout_s=STALL_S, now=0.0)
    if delivered:
        s.sent()
    got: list[TokenChunk] = []
    for t, c in enumerate(arrivals):
        assert s.receive(c) is None
        got.extend(s.drained(t * 0.01))
    assert "".join(texts(got)) == text
    assert s.done and s.finish_reason == "stop" and s.next_index == len(text)


# --- holes and Resume ---------------------------------------------------------------------------
def test_a_hole_after_tokens_went_out_asks_for_a_resume() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    s.receive(chunk(0, "ab"))
    assert texts(s.drained(0.0)) == ["ab"]
    s.sent()
    s.receive(chunk(4, "ef"))  # "cd" was lost
    assert s.drained(0.1) == []
    assert clocks(s, 0.1) == [Wait(DISCONNECT_POLL_S)]
    t = 0.1 + RESUME_HOLE_S
    assert clocks(s, t) == [SendResume(from_index=2), POLL_CLIENT, Wait(t + DISCONNECT_POLL_S)]
    assert s.resumes == 1
    s.receive(chunk(2, "cd"))  # republished
    assert texts(s.drained(t + 0.05)) == ["cd", "ef"]


def test_new_tokens_with_a_later_chunk_still_waiting_resume_soon() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    s.sent()
    feed(s, chunk(4, "ef"), chunk(0, "ab"))
    assert texts(s.drained(1.0)) == ["ab"]  # the stream moves, but "cd" is missing
    assert s.resume_at == 1.0 + RESUME_HOLE_S
    acts = clocks(s, 1.0 + RESUME_HOLE_S)
    assert acts[0] == SendResume(from_index=2)


def test_no_resume_before_the_client_got_anything() -> None:
    # Until a token went out the stream can still start over; a hole just waits (or the stall ends it).
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    s.receive(chunk(2, "cd"))
    assert s.drained(0.0) == []
    for t in (1.0, 5.0, 30.0):
        assert not any(isinstance(a, SendResume) for a in clocks(s, t))


def test_silence_after_tokens_resumes_with_backoff() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=1000.0, now=0.0)
    s.sent()
    s.receive(chunk(0, "ab"))
    s.drained(0.0)
    resumes_at: list[float] = []
    now = 0.0
    while now < 40.0:  # follow the Waits as Call.pull does, nothing arriving
        for act in clocks(s, now):
            if isinstance(act, SendResume):
                assert act.from_index == 2
                resumes_at.append(now)
            elif isinstance(act, Wait):
                assert act.until > now
                now = act.until
        s.drained(now)  # every wake drains the (empty) inbox first
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(resumes_at)]
    assert math.isclose(resumes_at[0], RESUME_IDLE_S, abs_tol=1e-9)
    assert gaps[:5] == [RESUME_EVERY_S, 2 * RESUME_EVERY_S, 4 * RESUME_EVERY_S, RESUME_MAX_S, RESUME_MAX_S]
    # A new token resets the backoff.
    s.receive(chunk(2, "c"))
    s.drained(now)
    assert clocks(s, now + RESUME_IDLE_S)[0] == SendResume(from_index=3)
    assert s.resume_at == now + RESUME_IDLE_S + RESUME_EVERY_S


def test_bus_gap_after_tokens_went_out_resumes_at_once() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    s.receive(chunk(0, "abc"))
    s.drained(0.0)
    s.sent()
    assert s.receive(BUS_GAP) is None  # no retry: the client already has tokens
    assert s.drained(0.05) == []
    assert clocks(s, 0.05) == [SendResume(from_index=3), Wait(DISCONNECT_POLL_S)]
    assert s.attempt == 0


# --- retries and errors -------------------------------------------------------------------------
def test_worker_lost_before_any_token_retries_while_attempts_remain() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    assert s.receive(lost("w1")) == Retry(attempt=1, lost_worker="w1", generated=(), reason="worker_lost")
    act = s.receive(lost("w2"))
    assert isinstance(act, Fail) and act.cancel is None
    assert (act.error.code, act.error.status) == ("worker_lost", 502)
    assert act.error.message == "worker w2 was lost after 2 attempts"


def test_worker_lost_after_tokens_migrates_with_the_tokens_so_far() -> None:
    """Sent or only collected (a non-streaming request), the tokens in order stay: the next attempt goes on
    after them, its chunks numbered from there; a migration does not use up max_attempts."""
    for sent in (False, True):
        s = ReplyStream(max_attempts=1, stall_timeout_s=STALL_S, now=0.0)
        s.receive(chunk(0, "ab"))
        assert texts(s.drained(0.0)) == ["ab"]
        if sent:
            s.sent()
        assert s.receive(lost("w1")) == Retry(attempt=1, lost_worker="w1", generated=(97, 98), reason="worker_lost")
        assert (s.attempt, s.next_index, s.migrations) == (1, 2, 1)
        feed(s, chunk(0, "ab", worker="w2"), chunk(2, "cd", worker="w2"), chunk(4, "", finish="length", worker="w2"))
        assert texts(s.drained(0.1)) == ["cd", ""] and s.done and s.finish_reason == "length"


def test_a_migration_keeps_undelivered_tokens_in_order_and_drops_the_rest() -> None:
    s = ReplyStream(max_attempts=3, stall_timeout_s=STALL_S, now=0.0)
    feed(s, chunk(0, "ab"), chunk(3, "d"))  # "c" never came from the lost worker
    act = s.receive(lost())
    assert isinstance(act, Retry) and act.generated == (97, 98)
    s.receive(chunk(2, "cx", worker="w2"))  # the new worker's "d" may differ (a real engine): the old one is gone
    assert texts(s.drained(0.0)) == ["ab", "cx"]


def test_migrations_are_bounded_by_the_migration_limit() -> None:
    s = ReplyStream(max_attempts=5, stall_timeout_s=STALL_S, now=0.0, migration_limit=2)
    s.receive(chunk(0, "ab"))
    s.drained(0.0)
    s.sent()
    assert isinstance(s.receive(lost("w1")), Retry)
    s.receive(chunk(2, "c", worker="w2"))
    assert isinstance(s.receive(lost("w2")), Retry)
    act = s.receive(lost("w3"))
    assert isinstance(act, Fail) and (act.error.code, act.error.status) == ("migration_limit", 502)
    assert act.error.message.startswith("worker w3 was lost after 2 migrations")


def test_migration_limit_zero_ends_a_stream_with_tokens_at_its_first_loss() -> None:
    s = ReplyStream(max_attempts=5, stall_timeout_s=STALL_S, now=0.0, migration_limit=0)
    s.receive(chunk(0, "ab"))
    act = s.receive(lost("w1"))
    assert isinstance(act, Fail) and act.error.code == "migration_limit"


def test_request_error_not_retryable_ends_the_request_with_its_own_error() -> None:
    s = ReplyStream(max_attempts=3, stall_timeout_s=STALL_S, now=0.0)
    err = req_error(retryable=False, code="context_length_exceeded")
    assert s.receive(err) == Fail(err.error)


def test_request_error_retryable_retries_then_fails_with_its_own_error() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    assert s.receive(req_error(retryable=True)) == Retry(attempt=1, lost_worker=None, reason="engine_error")
    err = req_error(retryable=True, code="out_of_blocks")
    assert s.receive(err) == Fail(err.error)  # attempts used up: the worker's error, not "worker lost"


def test_retryable_error_after_tokens_went_out_migrates() -> None:
    """A draining worker hands its unfinished streams over with a retryable error."""
    s = ReplyStream(max_attempts=1, stall_timeout_s=STALL_S, now=0.0)
    s.receive(chunk(0, "a"))
    s.drained(0.0)
    s.sent()
    act = s.receive(req_error(retryable=True, code="worker_draining"))
    assert act == Retry(attempt=1, lost_worker=None, generated=(97,), reason="worker_draining")


def test_bus_gap_before_any_token_starts_over_without_using_an_attempt() -> None:
    s = ReplyStream(max_attempts=1, stall_timeout_s=STALL_S, now=0.0)
    assert s.receive(BUS_GAP) == Retry(attempt=1, lost_worker=None, reason="bus_gap")
    assert s.receive(BUS_GAP) == Retry(attempt=2, lost_worker=None, reason="bus_gap")
    assert s.gap_retries == 2
    act = s.receive(lost("w3"))  # the one real attempt is still the only one allowed
    assert isinstance(act, Fail) and act.error.message == "worker w3 was lost after 3 attempts"


def test_abort_is_an_error_unless_we_cancelled() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    act = s.receive(chunk(0, "", finish="abort", worker="w9"))
    assert isinstance(act, Fail) and act.cancel is None
    assert (act.error.code, act.error.status, act.error.message) == ("aborted", 502, "worker w9 aborted the request")
    mine = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=0.0)
    mine.cancelled = True
    assert mine.receive(chunk(0, "", finish="abort")) is None
    assert mine.done and mine.finish_reason == "abort"


# --- clocks -------------------------------------------------------------------------------------
def test_stall_timeout_starts_a_silent_request_over_then_ends_it_and_cancels_it() -> None:
    # Nothing at all for the stall timeout (no token, no `Working`): the request or its stream was lost on the
    # way, nothing reached the client, so it starts over away from its placement; silent again, the 504.
    s = ReplyStream(max_attempts=2, stall_timeout_s=5.0, now=100.0)
    s.progress(100.0)
    assert clocks(s, 104.0) == [POLL_CLIENT, Wait(104.0 + DISCONNECT_POLL_S)]
    assert clocks(s, 105.0)[-1] == Retry(1, None, (), "stalled", exclude_placed=True)
    assert s.restarts == 1 and not s.cancelled
    s.progress(105.1)  # placed again
    out = clocks(s, 110.1)
    act = out[-1]
    assert isinstance(act, Fail) and act.cancel == "stalled"
    assert (act.error.code, act.error.status) == ("timeout", 504)
    assert act.error.message == "no response from the mesh for 5s"
    assert s.cancelled  # its own Cancel makes a later abort no news


def test_a_stream_that_stops_after_tokens_moves_on_elsewhere_at_the_stall_timeout() -> None:
    # Tokens came, then none for the stall timeout (a wedged engine under a live heartbeat): a migration
    # away from the placement's workers, within the migration limit; then the 504 as before.
    s = ReplyStream(max_attempts=3, stall_timeout_s=5.0, now=0.0, migration_limit=1)
    s.receive(chunk(0, "ab"))
    s.drained(0.0)
    s.sent()
    s.progress(0.0)
    act = clocks(s, 5.0)[-1]
    assert act == Retry(1, None, (ord("a"), ord("b")), "stalled", exclude_placed=True)
    assert s.migrations == 1 and not s.cancelled
    s.progress(5.1)  # placed again
    s.receive(chunk(2, "c"))
    s.drained(6.0)
    s.progress(6.0)
    last = clocks(s, 11.0)[-1]
    assert isinstance(last, Fail) and last.cancel == "stalled" and last.error.code == "timeout"


def test_working_is_no_token_and_no_action() -> None:
    # A worker at a long prefill: the driver restarts the stall clock for it (any message), nothing else happens.
    s = ReplyStream(max_attempts=2, stall_timeout_s=5.0, now=0.0)
    assert s.receive(Working(request_id="r", worker_id="w1")) is None
    assert s.drained(0.0) == [] and s.next_index == 0 and s.tokens == [] and not s.done


def test_progress_restarts_the_stall_clock() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=5.0, now=0.0)
    s.progress(0.0)
    s.progress(4.0)  # e.g. a message arrived
    acts = clocks(s, 8.9)
    assert not any(isinstance(a, Fail | Retry) for a in acts)
    assert isinstance(clocks(s, 9.0)[-1], Retry)  # stalled: it starts over


def test_chunks_back_to_back_still_poll_the_client_every_interval() -> None:
    # A fast engine leaves the driver no wait for the clocks: it asks poll_due as it hands chunks out, on the
    # same interval the clocks keep (and a poll it made is not made again by the clocks).
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=10.0)
    assert not s.poll_due(10.0) and not s.poll_due(10.0 + DISCONNECT_POLL_S / 2)
    assert s.poll_due(10.0 + DISCONNECT_POLL_S)
    assert not s.poll_due(10.0 + DISCONNECT_POLL_S * 1.5)
    (wait,) = clocks(s, 10.0 + DISCONNECT_POLL_S * 1.5)
    assert isinstance(wait, Wait) and math.isclose(wait.until, 10.0 + 2 * DISCONNECT_POLL_S)
    assert s.poll_due(10.0 + 2 * DISCONNECT_POLL_S)


def test_the_client_is_polled_every_interval_and_waits_wake_for_the_earliest_clock() -> None:
    s = ReplyStream(max_attempts=2, stall_timeout_s=STALL_S, now=10.0)
    assert clocks(s, 10.0) == [Wait(10.0 + DISCONNECT_POLL_S)]
    t = 10.0 + DISCONNECT_POLL_S
    assert clocks(s, t) == [POLL_CLIENT, Wait(t + DISCONNECT_POLL_S)]
    short = ReplyStream(max_attempts=2, stall_timeout_s=DISCONNECT_POLL_S / 2, now=10.0)
    assert clocks(short, 10.0) == [Wait(10.0 + DISCONNECT_POLL_S / 2)]  # the stall deadline comes first
