"""The `sim` engine: the batching core (hetmesh.batching) in real time over a simulated accelerator.

An asyncio shell: each step is what `Core.schedule` picks, lasts the cost model's time for it
divided by `time_scale` (slept), and is applied by `Core.update`; this shell samples the
tokens (hetmesh.engines.sampling), detokenizes, and hands outputs to stream consumers. The
offline simulator runs the same core, so the steps are the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from hetmesh.batching import Core, Kind, KvEventBatch, Seq, Settings, State, Step
from hetmesh.costmodel.learn import StepLog, StepSample
from hetmesh.costmodel.truth import Truth
from hetmesh.engines.base import EngineError, EngineOutput, EngineRequest, EngineStats
from hetmesh.engines.sampling import Completion, Sampler
from hetmesh.kvstream import DroppedKv, KvSink
from hetmesh.protocol import Phase, TokenLogprob
from hetmesh.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_KIND = {Phase.FULL: Kind.FULL, Phase.PREFILL: Kind.PREFILL, Phase.DECODE: Kind.DECODE}

# Pacing of the asyncio loop (how simulated time maps onto wall time; not batching behaviour).
MIN_SLEEP_S = 0.0005  # below this much owed simulated time the loop keeps stepping (timer granularity)
MAX_BURST_S = 0.0001  # wall time the loop may run steps back to back before yielding
# After a first token, yield this many times in a row: the token crosses several tasks (consumer,
# NATS flusher) before it leaves the process, and each would otherwise wait for a whole burst.
FIRST_TOKEN_YIELDS = 3
# Tokens of consecutive steps are merged and handed to stream consumers at most this often (first
# tokens and final outputs go at once), so a fast accelerator costs few messages per token.
STREAM_INTERVAL_S = 0.002
# Engine time the loop may owe and win back (wall seconds): each step's own Python work and the timer's
# overshoot come out of the next sleep instead of stretching engine time, so a step takes dt on average,
# as in the simulator. A longer stall (the process descheduled) is dropped, not paid back in a burst.
MAX_LAG_S = 0.05


class StepTimer(Protocol):
    """What the engine needs from hetmesh.costmodel.CostModel: the one step-time API."""

    def step_seconds(self, step: Step) -> float: ...


class _Live:
    """One request in the shell: its sampler, text, and the output buffer its consumer has not taken."""

    __slots__ = ("comp", "event", "finish_reason", "finished", "ids", "index", "lps", "parts", "req", "sampler",
                 "seq", "submitted")

    def __init__(self, req: EngineRequest, sampler: Sampler, comp: Completion, seq: Seq) -> None:
        self.req = req
        self.sampler = sampler
        self.comp = comp
        self.seq = seq
        self.event = asyncio.Event()
        self.index = 0  # completion position of ids[0]
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.lps: list[TokenLogprob] = []  # logprobs of `ids`, when the request asked for them
        self.finished = False
        self.finish_reason: str | None = None
        self.submitted = time.perf_counter()  # the clock the engine hands the core (Seq.admitted_at)

    def take(self) -> EngineOutput:
        s = self.seq
        out = EngineOutput(request_id=self.req.request_id, index=self.index, token_ids=self.ids,
                           text="".join(self.parts), finished=self.finished, finish_reason=self.finish_reason,
                           prompt_tokens=s.prompt_len - self.req.continued,
                           cached_tokens=min(s.cached_tokens, s.prompt_len - self.req.continued),
                           completion_tokens=len(self.comp.token_ids),
                           queued_s=s.admitted_at - self.submitted if s.admitted_at >= 0 else 0.0,
                           logprobs=self.lps if self.req.sampling.logprobs is not None else None)
        self.index += len(self.ids)
        self.ids = []
        self.parts = []
        self.lps = []
        return out


class SimEngine:
    real_kv = False
    name = "sim"

    def __init__(self, tokenizer: Tokenizer, timer: StepTimer, settings: Settings | None = None,
                 time_scale: float = 1.0, truth: Truth | None = None) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.tok = tokenizer
        self.timer = timer
        self.settings = settings or Settings()
        self.time_scale = time_scale
        self.core = Core(self.settings, track_decodes=True)
        self._live: dict[str, _Live] = {}  # in the core (waiting or running)
        self._streams: dict[str, _Live] = {}  # until the consumer has taken the last output
        self._dirty: set[_Live] = set()  # have output the consumer has not been woken for
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failed: str | None = None
        self.aborted = 0
        self.busy_s = 0.0
        self.steps: list[tuple[object, ...]] | None = None  # Step.signature() of every step, when recording
        self.truth = truth or Truth()  # what this simulated chip really runs at (the scheduler prices the prior)
        self._log = StepLog()  # the steps since the last heartbeat, with their engine seconds
        self._t0 = -1.0  # loop time the engine started: the truth's clock

    @property
    def cache(self):  # type: ignore[no-untyped-def]  # the core's KV memory (tests read its free blocks)
        return self.core.cache

    # -- lifecycle

    async def start(self) -> None:
        if self._task is None:
            self.core.cache.clear_all()  # a fresh engine holds nothing: tell the index
            self._t0 = asyncio.get_running_loop().time()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def close(self) -> None:
        for rid in list(self._live):
            await self.abort(rid)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # -- the interface

    async def submit(self, request: EngineRequest) -> None:
        rid = request.request_id
        if self.failed:
            raise EngineError(self.failed)
        if rid in self._live:
            raise EngineError(f"request {rid!r} is already in this engine")
        sampling = request.sampling
        prompt = request.prompt_tokens
        k = request.continued
        if k:  # migrated: the original prompt seeds the sampler, the completion so far replays below
            prompt = prompt[:len(prompt) - k]
            sampling = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens + k)
        sampler = Sampler(self.tok, prompt, sampling)
        comp = Completion(self.tok, sampling)
        kind = _KIND[request.phase]
        first = request.first_token_ids if kind == Kind.DECODE else []
        # Replay the completion so far (a migration's, then DECODE's first tokens): the random stream, the
        # held-back text and the token count are then where the aggregated run has them.
        for t in (*request.prompt_tokens[len(prompt):], *first):
            sampler.next()
            comp.append(t)
        sampling = request.sampling
        max_new = 1 if kind == Kind.PREFILL else sampling.max_tokens
        if comp.finish_reason is not None:
            max_new = len(first)  # the first tokens already ended it: it finishes on admission
        seq = Seq(rid, kind, len(request.prompt_tokens), request.block_hashes, max_new, len(first), request.priority)
        try:
            self.core.add(seq)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        lv = _Live(request, sampler, comp, seq)
        lv.index = k + len(first)
        self._streams[rid] = lv
        self._live[rid] = lv
        self._wake.set()

    async def stream(self, request_id: str) -> AsyncIterator[EngineOutput]:
        lv = self._streams.get(request_id)
        if lv is None:
            raise EngineError(f"unknown request {request_id!r}")
        try:
            while True:
                await lv.event.wait()
                lv.event.clear()
                if not lv.ids and not lv.finished:
                    continue
                out = lv.take()
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.get(request_id) is lv and request_id not in self._live:
                del self._streams[request_id]

    async def abort(self, request_id: str) -> bool:
        lv = self._live.pop(request_id, None)
        if lv is None:
            return False
        self.core.abort(request_id)
        self.aborted += 1
        self._emit(lv, None, "", "abort", True)
        return True

    def started(self, request_id: str) -> bool:
        lv = self._live.get(request_id)
        return lv is not None and (lv.seq.state != State.WAITING or lv.seq.admitted_at >= 0)  # preempted: started

    def stats(self) -> EngineStats:
        c = self.core
        st = c.stats
        return EngineStats(waiting=c.n_waiting, running=len(c.running), max_batch=self.settings.max_batch,
                           kv_blocks_total=self.settings.kv_blocks, kv_blocks_used=c.cache.used,
                           kv_blocks_cached=c.cache.cached_blocks, block_size=self.settings.block_size,
                           tokens_generated=st.tokens_generated, prompt_tokens_computed=st.prompt_tokens_computed,
                           prompt_tokens_cached=st.prompt_tokens_cached, aborted=self.aborted,
                           preempted=st.preempted, steps=st.steps, busy_s=self.busy_s)

    def step_log(self) -> list[StepSample]:
        return self._log.drain()

    def kv_events(self) -> KvEventBatch:
        return self.core.cache.drain()

    def take_kv(self, request_id: str) -> bytes | None:
        return None  # simulated KV: the worker sends the cost model's byte count

    def put_kv(self, request_id: str, data: bytes) -> None:
        return None

    def kv_sink(self, request_id: str, nbytes: int) -> KvSink:
        return DroppedKv()  # the bytes crossed the wire; their content means nothing here

    # -- outputs

    def _emit(self, lv: _Live, tok: int | None, text: str, reason: str | None, finished: bool) -> None:
        """Append to the output buffer; wake the consumer now for first tokens and ends, else at the next flush."""
        urgent = finished or (not lv.index and not lv.ids)
        if tok is not None:
            lv.ids.append(tok)
        if text:
            lv.parts.append(text)
        if finished:
            lv.finished, lv.finish_reason = True, reason
        if urgent:
            lv.event.set()
            self._dirty.discard(lv)
        else:
            self._dirty.add(lv)

    def _flush(self) -> None:
        for lv in self._dirty:
            lv.event.set()
        self._dirty.clear()

    def _end(self, lv: _Live, tok: int | None, text: str, reason: str | None) -> None:
        del self._live[lv.req.request_id]
        self._emit(lv, tok, text, reason, True)

    def _sample(self, lv: _Live) -> None:
        tok = lv.sampler.next()
        if lv.sampler.last is not None:
            lv.lps.append(lv.sampler.last)
        text = lv.comp.append(tok)
        seq = lv.seq
        if lv.comp.finish_reason is not None:
            if seq.state != State.DONE:
                self.core.finish(seq.rid)  # a stop string or EOS before the token limit
            self._end(lv, tok, text, lv.comp.finish_reason)
        elif seq.kind == Kind.PREFILL:
            self._end(lv, tok, text, None)  # handed off: the decode worker continues once the KV landed
        else:
            self._emit(lv, tok, text, None, False)

    def _apply(self, step: Step) -> bool:
        """Update the core with a step that ran and sample its tokens; True if one was a first token."""
        out = self.core.update(step)
        live = self._live
        first = False
        for s in out.sampled:
            lv = live.get(s.rid)
            if lv is not None and lv.seq is s:
                first |= not lv.comp.token_ids
                self._sample(lv)
        for s in step.decodes or ():
            lv = live.get(s.rid)
            if lv is not None and lv.seq is s:
                self._sample(lv)
        return first

    # -- the loop

    async def _loop(self) -> None:
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Never leave a consumer waiting: every request ends with "error" and the engine refuses new work.
            log.exception("sim engine loop failed")
            self.failed = f"engine failed: {exc!r}"
            for rid, lv in list(self._live.items()):
                self.core.abort(rid)
                self._end(lv, None, "", "error")

    def _ended_on_admission(self, step: Step) -> None:
        for s in step.ended:  # DECODEs whose first tokens had already ended them
            lv = self._live.get(s.rid)
            if lv is not None:
                self._end(lv, None, "", lv.comp.finish_reason)

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        target = loop.time()  # simulated clock, in wall time
        last_yield = last_flush = target
        while True:
            if core.idle:
                self._flush()
                self._wake.clear()
                await self._wake.wait()
                target = last_yield = loop.time()
                continue
            step = core.schedule(time.perf_counter())  # the clock of _Live.submitted: queued_s
            self._ended_on_admission(step)
            if step.empty:  # only DECODEs that ended on admission this round
                await asyncio.sleep(0)
                continue
            if self.steps is not None:
                self.steps.append(step.signature())
            now = loop.time()
            engine_s = self.timer.step_seconds(step) * self.truth.factor((now - self._t0) * self.time_scale)
            self._log.add(StepSample.of(step, engine_s))
            dt = engine_s / self.time_scale
            self.busy_s += dt
            target = max(target, now - MAX_LAG_S) + dt
            owed = target - now
            if owed > MIN_SLEEP_S:
                if now - last_flush >= STREAM_INTERVAL_S:
                    self._flush()
                    last_flush = now
                await asyncio.sleep(owed)
                last_yield = loop.time()
            first = self._apply(step)
            now = loop.time()
            if now - last_flush >= STREAM_INTERVAL_S:
                self._flush()
                last_flush = now
            # Yield promptly after a first token (TTFT) and at least every MAX_BURST_S so that new work
            # and the consumers get the loop; consumers are only woken by first tokens, ends and flushes.
            if first:
                for _ in range(FIRST_TOKEN_YIELDS):
                    await asyncio.sleep(0)
                last_yield = loop.time()
            elif now - last_yield > MAX_BURST_S:
                await asyncio.sleep(0)
                last_yield = loop.time()
