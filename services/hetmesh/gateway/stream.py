"""One request's reply stream as a pure state machine: messages and clock readings in, actions out.

The gateway's `Call` (call.py) owns the I/O: it awaits the request's inbox, feeds what arrives to
`ReplyStream`, and carries out what comes back (send a Resume, poll the client, submit a retry,
publish a Cancel, hand chunks or an error to the client side). Nothing here awaits, publishes or reads
a clock (`now` is always passed in), so every rule about reordering, holes, retries and stalls is
unit-testable without a mesh, like core.py's rules about bodies and bytes.

A retry (the worker lost, drained, or a retryable error) never starts over: the next attempt goes on
after the tokens in order so far (`Retry.generated`, a migration when there are any), and the one
Reassembler numbers its chunks on from there, so the client sees one stream. Restarts with no token
are bounded by `max_attempts`, migrations by `migration_limit`; a bus gap's retries use up neither, nor does
one placement its scheduler withdrew before any token (hetmesh.placement.withdrawal: once per request).

The driver's loop, per `pull` (call.Call.pull is the one real driver):

    progress(now)                                  # the client asked for more: the stall clock restarts
    loop:
        for each message: receive(msg)             # -> None | Fail | Retry (then progress(now) once placed)
                                                   #    Fail: drained(now)'s chunks go out first, then `failure`
        drained(now)                               # -> the chunks for the client, if any: return them
        tick(now) until Wait                       # -> SendResume | POLL_CLIENT | Fail (stalled)
        wait for a message until Wait.until; progress(now) if one came
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetmesh.protocol import ErrorInfo, RequestError, TokenChunk, Usage, WorkerLost, Working

from .core import Reassembler, usage_of

# How often a waiting request asks the server whether its client is still there. A poll, not a
# watcher task per request: requests shorter than this never pay for the check at all.
DISCONNECT_POLL_S = 0.2
# A stream that already sent tokens cannot start over; a hole in it is filled by asking the workers
# to publish its chunks again (protocol.Resume): at once after a bus reconnect, after RESUME_HOLE_S
# with a chunk waiting for a missing one, after RESUME_IDLE_S of silence; then again after RESUME_EVERY_S,
# doubling up to RESUME_MAX_S while nothing new comes (a long wait for KV is silence too).
RESUME_HOLE_S = 0.5
RESUME_IDLE_S = 2.0
RESUME_EVERY_S = 1.0
RESUME_MAX_S = 8.0


class BusGap:
    """NATS reconnected: messages published during the outage may be lost."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "BUS_GAP"


BUS_GAP = BusGap()  # the one instance; the gateway puts it in every inbox on reconnect

Message = TokenChunk | RequestError | WorkerLost | Working | BusGap


# --- actions ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Retry:
    """Submit the request again as `attempt`, excluding `lost_worker` when there is one, going on after
    `generated` (the completion tokens the stream already has, in order): a migration when there are any.

    The state is already the new attempt's: the old attempt's messages still queued must be dropped,
    and `progress(now)` called once the new attempt is placed.
    """

    attempt: int
    lost_worker: str | None
    generated: tuple[int, ...] = ()
    reason: str = ""  # worker_lost | retryable code of the worker's error | bus_gap | stalled
    exclude_placed: bool = False  # stalled: the last placement's workers are excluded too (none was lost)


@dataclass(frozen=True, slots=True)
class Fail:
    """The request ends with `error`; publish a Cancel with reason `cancel` when one is given."""

    error: ErrorInfo
    cancel: str | None = None


@dataclass(frozen=True, slots=True)
class SendResume:
    """Ask the workers to publish this attempt's chunks from `from_index` on again."""

    from_index: int


class PollClient:
    """Ask the HTTP server whether the client is still connected (end the request if not)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "POLL_CLIENT"


POLL_CLIENT = PollClient()


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until a message arrives or the clock reaches `until`."""

    until: float


# --- the state machine -------------------------------------------------------------------------
class ReplyStream:
    """Everything the gateway keeps about one request's reply stream, across its attempts."""

    __slots__ = ("attempt", "cancelled", "delivered", "failure", "gap_retries", "max_attempts", "migration_limit",
                 "migrations", "poll_client_at", "ready", "reasm", "restarts", "resume_at", "resume_every", "resumes",
                 "stall_at", "stall_s", "tokens", "withdrawn")

    def __init__(self, max_attempts: int, stall_timeout_s: float, now: float, migration_limit: int = 3) -> None:
        self.max_attempts = max_attempts
        self.migration_limit = migration_limit
        self.stall_s = stall_timeout_s
        # One for all attempts: a new attempt goes on after the tokens in order so far, numbering from there.
        self.reasm = Reassembler()
        self.tokens: list[int] = []  # the completion's token ids in order so far (what a migration re-submits)
        self.ready: list[TokenChunk] = []  # deliverable, not yet handed out
        self.attempt = 0
        self.gap_retries = 0  # attempts started because the bus reconnected (they use up nothing)
        self.withdrawn = False  # an attempt's placement was withdrawn by its scheduler (uses up nothing, once)
        self.restarts = 0  # attempts started with no token yet (bounded by max_attempts)
        self.migrations = 0  # attempts that went on after some tokens (bounded by migration_limit)
        self.delivered = False  # some token reached the client: no more retries
        self.cancelled = False  # a Cancel went out (or the mesh ended it): an abort is then our own doing
        # A message ended the request: the error the client gets once the chunks in order before it went out.
        self.failure: ErrorInfo | None = None
        self.resumes = 0
        self.resume_at = math.inf  # when to ask the workers to publish this stream again (once delivered)
        self.resume_every = RESUME_EVERY_S
        self.stall_at = now + stall_timeout_s
        self.poll_client_at = now + DISCONNECT_POLL_S

    # --- what the client side reads -------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.reasm.done

    @property
    def finish_reason(self) -> str | None:
        return self.reasm.finish_reason

    @property
    def next_index(self) -> int:
        """Tokens of the current attempt put in order so far."""
        return self.reasm.next_index

    def usage(self, prompt_len: int) -> Usage:
        return usage_of(self.reasm, prompt_len)

    def can_retry(self) -> bool:
        if self.reasm.next_index:
            return self.migrations < self.migration_limit
        return self.restarts + 1 < self.max_attempts

    # --- events in ------------------------------------------------------------------------------
    def sent(self) -> None:
        """Tokens reached the client: from now on the stream cannot start over, only be resumed."""
        self.delivered = True

    def progress(self, now: float) -> None:
        """The client asked for more, messages arrived, or a retry was placed: the stall clock restarts."""
        self.stall_at = now + self.stall_s

    def receive(self, msg: Message) -> Retry | Fail | None:
        """One message from the inbox. Chunks are kept for `drained`; None means read on."""
        if type(msg) is TokenChunk:  # the hot path: one per token batch
            if msg.finish_reason == "abort" and not self.cancelled:
                return self._end(ErrorInfo(message=f"worker {msg.worker_id} aborted the request",
                                           type="server_error", code="aborted", status=502))
            got = self.reasm.add(msg)
            if got:
                self.ready.extend(got)
                for c in got:
                    self.tokens.extend(c.token_ids)
            return None
        if type(msg) is RequestError and not msg.retryable:
            return self._end(msg.error)
        if type(msg) is Working:  # a worker still at it: news enough for the stall clock (progress), no more
            return None
        if msg is BUS_GAP:
            if self.delivered:
                self.resume_at = -math.inf  # tokens went out: it cannot start over, so fill the hole at once
                return None
            # Chunks or the reply may have been published while this gateway was disconnected and be
            # gone: nothing reached the client yet, so place it again, after the tokens it has (uses up nothing).
            self.gap_retries += 1
            return self._retry(None, "bus_gap", counted=False)
        assert type(msg) is WorkerLost or type(msg) is RequestError  # a retryable error
        if type(msg) is RequestError and msg.error.code == "withdrawn" and not self.withdrawn and not self.tokens:
            # Its scheduler took the placement back before the engine started it: placed anew (`moved`, so it
            # stays where it lands then); a withdrawn migration counts as one.
            self.withdrawn = True
            return self._retry(None, "withdrawn", counted=False)
        if not self.can_retry():
            return self._end(self._lost_info(msg))
        if type(msg) is WorkerLost:
            return self._retry(msg.worker_id, "worker_lost")
        return self._retry(None, msg.error.code or "retryable_error")

    def drained(self, now: float) -> list[TokenChunk]:
        """The inbox is empty for now: the chunks for the client, in completion order (maybe none)."""
        ready = self.ready
        if self.delivered:
            if ready:
                # The stream moves: look again after a short while if a chunk waits on a missing one.
                self.resume_at = now + (RESUME_HOLE_S if self.reasm.pending else RESUME_IDLE_S)
                self.resume_every = RESUME_EVERY_S
            elif self.reasm.pending:
                self.resume_at = min(self.resume_at, now + RESUME_HOLE_S)
        if ready:
            self.ready = []
        return ready

    def poll_due(self, now: float) -> bool:
        """Whether to ask the server now if the client is still there (every DISCONNECT_POLL_S). The clocks ask
        between messages; chunks that arrive back to back leave the driver no wait, so it asks itself as it
        hands them out (an ASGI server's send to a gone client returns quietly: nothing else would tell)."""
        if now < self.poll_client_at:
            return False
        self.poll_client_at = now + DISCONNECT_POLL_S
        return True

    def tick(self, now: float) -> SendResume | PollClient | Fail | Retry | Wait:
        """What the clocks ask for at `now`; call again after carrying it out, until it says Wait."""
        if now >= self.resume_at:
            self.resumes += 1
            self.resume_at = now + self.resume_every
            self.resume_every = min(2 * self.resume_every, RESUME_MAX_S)
            return SendResume(self.reasm.next_index)
        if self.poll_due(now):
            return POLL_CLIENT
        if now >= self.stall_at:
            if self.can_retry():
                # Tokens flowed, then none for the stall timeout: a decode step takes far less, so its worker
                # has stopped (an engine wedged under a live heartbeat, or a loss no scheduler saw). Or none came
                # and no worker said it works (one that holds it says `Working` every quarter of the timeout):
                # its WorkItem or its whole stream went down with a bus node. The stream moves on elsewhere, or
                # starts over (nothing reached the client); the old attempt's reply subject is dead, so a late
                # chunk from it is no news.
                return self._retry(None, "stalled", exclude_placed=True)
            # A worker may still be generating for nobody: it gets a Cancel, and its abort is no news.
            self.cancelled = True
            return Fail(ErrorInfo(message=f"no response from the mesh for {self.stall_s:g}s", type="server_error",
                                  code="timeout", status=504), cancel="stalled")
        return Wait(min(self.stall_at, self.poll_client_at, self.resume_at))

    # --- internals -------------------------------------------------------------------------------
    def _end(self, error: ErrorInfo) -> Fail:
        """The mesh ended the request. Chunks that came in order before the message that ended it (in the
        same read of the inbox) are still the client's: the driver hands out `drained` first, then `failure`."""
        self.failure = error
        return Fail(error)

    def _retry(self, lost_worker: str | None, reason: str, counted: bool = True, exclude_placed: bool = False) -> Retry:
        """The next attempt goes on after the tokens in order so far (the old worker's out-of-order ones are
        dropped): with the sim engine, or greedy sampling, the new worker continues with the same text."""
        self.reasm.pending.clear()
        if counted:
            if self.reasm.next_index:
                self.migrations += 1
            else:
                self.restarts += 1
        self.attempt += 1
        self.resume_at = math.inf  # the new attempt's stream starts afresh
        self.resume_every = RESUME_EVERY_S
        return Retry(self.attempt, lost_worker, tuple(self.tokens), reason, exclude_placed)

    def _lost_info(self, msg: WorkerLost | RequestError) -> ErrorInfo:
        if self.reasm.next_index:
            who = f"worker {msg.worker_id} was lost" if type(msg) is WorkerLost else msg.error.message
            return ErrorInfo(message=f"{who} after {self.migrations} migrations (mesh.migration_limit); the "
                                     f"stream ends after {self.reasm.next_index} tokens", type="server_error",
                             code="migration_limit", status=502)
        if type(msg) is RequestError:
            return msg.error
        return ErrorInfo(message=f"worker {msg.worker_id} was lost after {self.attempt + 1} attempts",
                         type="server_error", code="worker_lost", status=502)
