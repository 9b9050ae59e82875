"""The `sim` engine: continuous batching over a simulated accelerator.

Scheduling, the prefix cache and sampling are real; only the math is replaced by sleeping
for the cost model's step time divided by `time_scale`. Generated tokens are a deterministic
function of (prompt tokens, seed), defined once by `Sampler` + `Completion`;
`expected_completion` runs exactly that code so tests can predict the text.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from hashlib import blake2b
from typing import Protocol

from msgspec import Struct

from hetmesh.engines.base import EngineError, EngineOutput, EngineRequest, EngineStats, KvEventBatch
from hetmesh.kvindex.blocks import cached_prefix_blocks
from hetmesh.kvstream import DroppedKv, KvSink
from hetmesh.protocol import Phase, SamplingParams
from hetmesh.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Chance that a sampled token is EOS (unless ignore_eos): mean natural length ~ 1/EOS_PROB.
EOS_PROB = 1.0 / 512


class StepTimer(Protocol):
    """What the engine needs from hetmesh.costmodel.CostModel."""

    def step_time(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float: ...


class SimConfig(Struct, kw_only=True):
    max_batch: int = 64
    kv_blocks: int = 4096
    block_size: int = 16
    time_scale: float = 1.0  # simulated time runs this many times faster than wall time (1e6: negligible)
    max_batched_tokens: int = 2048  # per-step token budget; longer prompts are prefilled in chunks
    # Below this much owed simulated time the loop keeps stepping instead of sleeping (timer granularity).
    min_sleep_s: float = 0.0005
    max_burst_s: float = 0.0001  # wall time the loop may run steps back to back before yielding
    # After a first token, yield this many times in a row: the token crosses several tasks (consumer,
    # NATS flusher) before it leaves the process, and each would otherwise wait for a whole burst.
    first_token_yields: int = 3
    # Tokens of consecutive steps are merged and handed to stream consumers at most this often
    # (first tokens and final outputs go at once), so a fast accelerator costs few messages per token.
    stream_interval_s: float = 0.002


# ---------------------------------------------------------------- deterministic generation

class Sampler:
    """The token stream of one request: a PRNG seeded from the prompt and (temperature > 0) the seed."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: Sequence[int], sampling: SamplingParams) -> None:
        h = blake2b(array("q", prompt_tokens).tobytes(), digest_size=16)
        if sampling.temperature > 0:
            h.update(b"seed:%d" % (sampling.seed or 0))
        self._rng = random.Random(int.from_bytes(h.digest(), "little"))
        self._vocab = _vocab(tokenizer)
        self._eos = tokenizer.eos_id
        self._ignore_eos = sampling.ignore_eos

    def next(self) -> int:
        # Always draw both numbers so ignore_eos does not shift the rest of the stream.
        rand = self._rng.random
        r = rand()
        tok = self._vocab[int(rand() * len(self._vocab))]
        return self._eos if r < EOS_PROB and not self._ignore_eos else tok


_piece_cache: dict[tuple[int, int], str] = {}
_vocab_cache: dict[int, tuple[Tokenizer, Sequence[int]]] = {}


def _vocab(tokenizer: Tokenizer) -> Sequence[int]:
    # Keyed by id() but holding the tokenizer, so a key is never reused by another object.
    hit = _vocab_cache.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = _vocab_cache[id(tokenizer)] = (tokenizer, tuple(tokenizer.generation_vocab()))
    return hit[1]


def _piece(tokenizer: Tokenizer, tok: int) -> str:
    key = (id(tokenizer), tok)
    s = _piece_cache.get(key)
    if s is None:
        s = _piece_cache[key] = tokenizer.decode([tok])
    return s


class Completion:
    """Detokenizing, stop strings, eos and max_tokens for one request.

    Text that might be the start of a stop string is held back until it is known not to be;
    a matched stop string and everything after it is never emitted.
    """

    def __init__(self, tokenizer: Tokenizer, sampling: SamplingParams) -> None:
        self.tok = tokenizer
        self.sampling = sampling
        self.stops = [s for s in sampling.stop if s]
        self.token_ids: list[int] = []
        self.text = ""  # the full text so far (with stop strings; without them see `output_text`)
        self._parts: list[str] = []  # the text as pieces (no stop strings)
        self.emitted = 0  # len of text already handed out
        self.finish_reason: str | None = None

    @property
    def output_text(self) -> str:
        return self.text if self.stops else "".join(self._parts)

    def _holdback(self) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.emitted), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def append(self, tok: int) -> str:
        """Add a token; return the newly emittable text."""
        self.token_ids.append(tok)
        if not self.stops:  # fast path: no hold-back, nothing to search
            piece = ""
            if tok == self.tok.eos_id and not self.sampling.ignore_eos:
                self.finish_reason = "stop"
            else:
                piece = _piece(self.tok, tok)
                self._parts.append(piece)
            if self.finish_reason is None and len(self.token_ids) >= self.sampling.max_tokens:
                self.finish_reason = "length"
            return piece
        if tok == self.tok.eos_id and not self.sampling.ignore_eos:
            self.finish_reason = "stop"
        else:
            self.text += _piece(self.tok, tok)
            cut = -1
            for s in self.stops:
                p = self.text.find(s, self.emitted)
                if p >= 0 and (cut < 0 or p < cut):
                    cut = p
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.token_ids) >= self.sampling.max_tokens:
            self.finish_reason = "length"
        end = len(self.text) if self.finish_reason else len(self.text) - self._holdback()
        new = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return new


def expected_completion(
    tokenizer: Tokenizer, prompt_tokens: Sequence[int], sampling: SamplingParams
) -> tuple[list[int], str, str]:
    """(token_ids, text, finish_reason) the sim engine produces for this prompt: its own definition."""
    sampler = Sampler(tokenizer, prompt_tokens, sampling)
    comp = Completion(tokenizer, sampling)
    while comp.finish_reason is None:
        comp.append(sampler.next())
    return comp.token_ids, comp.output_text, comp.finish_reason


# ---------------------------------------------------------------- the prefix cache

class PrefixCache:
    """Block-hash LRU over a bounded number of KV blocks, with refcounted pinning.

    `private` counts blocks held by running requests that are not (yet) keyed by a hash:
    the partial tail, generated tokens, and prompt blocks still being computed.
    """

    def __init__(self, total_blocks: int) -> None:
        self.total = total_blocks
        self.refs: dict[int, int] = {}  # every cached block -> pin count
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned cached blocks, oldest first
        self.private = 0
        self._pending: dict[int, bool] = {}  # hash -> stored (True) / removed (False), net since drain
        self._cleared = False

    @property
    def free(self) -> int:
        return self.total - len(self.refs) - self.private

    @property
    def used(self) -> int:
        """Blocks that cannot be reclaimed right now."""
        return self.total - self.free - len(self.lru)

    def hit_blocks(self, hashes: Sequence[int]) -> int:
        return cached_prefix_blocks(hashes, self.refs.__contains__)

    def pin(self, h: int) -> None:
        n = self.refs[h]
        if n == 0:
            del self.lru[h]
        self.refs[h] = n + 1

    def unpin(self, h: int) -> None:
        n = self.refs[h] - 1
        self.refs[h] = n
        if n == 0:
            self.lru[h] = None  # most recently used end

    def reserve(self, n: int) -> bool:
        """Take n private blocks, evicting least recently used prefixes if needed."""
        if self.free + len(self.lru) < n:
            return False
        while self.free < n:
            h, _ = self.lru.popitem(last=False)
            del self.refs[h]
            self._note(h, False)
        self.private += n
        return True

    def release(self, n: int) -> None:
        self.private -= n

    def store(self, h: int) -> bool:
        """Turn one private block into the cached, pinned block `h`. False if it was cached already."""
        self.private -= 1
        if h in self.refs:
            self.pin(h)
            return False
        self.refs[h] = 1
        self._note(h, True)
        return True

    def _note(self, h: int, stored: bool) -> None:
        # Net effect only: stored-then-evicted within one drain window need not reach the index.
        if self._pending.pop(h, None) is None or stored:
            self._pending[h] = stored

    def drain(self) -> KvEventBatch:
        batch = KvEventBatch(
            stored=[h for h, s in self._pending.items() if s],
            removed=[h for h, s in self._pending.items() if not s],
            cleared=self._cleared,
        )
        self._pending.clear()
        self._cleared = False
        return batch


# ---------------------------------------------------------------- the engine

class _Stream:
    """Per-request output buffer: tokens the consumer has not taken yet are merged into one output."""

    __slots__ = ("event", "finish_reason", "finished", "ids", "index", "parts")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.index = 0  # completion position of ids[0]
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.finished = False
        self.finish_reason: str | None = None

    def take(self, r: _Req) -> EngineOutput:
        out = EngineOutput(request_id=r.req.request_id, index=self.index, token_ids=self.ids,
                           text="".join(self.parts), finished=self.finished, finish_reason=self.finish_reason,
                           prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens,
                           completion_tokens=len(r.comp.token_ids), queued_s=max(r.queued_s, 0.0))
        self.index += len(self.ids)
        self.ids = []
        self.parts = []
        return out


class _Req:
    __slots__ = ("admitted", "blocks_reserved", "cached_tokens", "capacity", "comp", "computed", "pinned",
                 "prompt_len", "queued_s", "req", "sampler", "stream", "submitted", "target")

    def __init__(self, req: EngineRequest, sampler: Sampler, comp: Completion, stream: _Stream) -> None:
        self.req = req
        self.sampler = sampler
        self.comp = comp
        self.stream = stream
        self.prompt_len = len(req.prompt_tokens)
        self.target = self.prompt_len  # tokens whose KV must be present before the next sample
        self.computed = 0  # of those, the ones whose KV is present
        self.cached_tokens = 0
        self.admitted = False
        self.capacity = 0  # tokens the blocks it holds can store
        self.pinned: list[int] = []  # cached block hashes this request holds a pin on
        self.blocks_reserved = 0  # private blocks
        self.submitted = time.perf_counter()
        self.queued_s = -1.0  # until its first admission

    @property
    def context(self) -> int:
        return self.prompt_len + len(self.comp.token_ids)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class SimEngine:
    real_kv = False
    name = "sim"

    def __init__(self, tokenizer: Tokenizer, timer: StepTimer, config: SimConfig | None = None) -> None:
        self.tok = tokenizer
        self.timer = timer
        self.cfg = config or SimConfig()
        self.cache = PrefixCache(self.cfg.kv_blocks)
        self._waiting: deque[_Req] = deque()
        self._running: dict[str, _Req] = {}
        self._streams: dict[str, _Req] = {}  # until the consumer has taken the last output
        self._reqs: dict[str, _Req] = {}  # waiting or running
        self._dirty: set[_Req] = set()  # have output the consumer has not been woken for
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failed: str | None = None
        self._stats = EngineStats(waiting=0, running=0, max_batch=self.cfg.max_batch,
                                  kv_blocks_total=self.cfg.kv_blocks, kv_blocks_used=0, kv_blocks_cached=0,
                                  block_size=self.cfg.block_size)

    # -- lifecycle

    async def start(self) -> None:
        if self._task is None:
            self.cache._cleared = True  # a fresh engine holds nothing: tell the index
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def close(self) -> None:
        for rid in list(self._reqs):
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
        if rid in self._reqs:
            raise EngineError(f"request {rid!r} is already in this engine")
        if not request.prompt_tokens:
            raise EngineError("empty prompt")
        need = self._blocks_needed(request)
        if need > self.cfg.kv_blocks:
            raise EngineError(f"request needs {need} KV blocks; this engine has {self.cfg.kv_blocks}")
        stream = _Stream()
        if request.phase == Phase.DECODE:
            stream.index = len(request.first_token_ids)
        r = _Req(request, Sampler(self.tok, request.prompt_tokens, request.sampling),
                 Completion(self.tok, request.sampling), stream)
        self._streams[rid] = r
        self._reqs[rid] = r
        self._waiting.append(r)
        self._wake.set()

    async def stream(self, request_id: str) -> AsyncIterator[EngineOutput]:
        r = self._streams.get(request_id)
        if r is None:
            raise EngineError(f"unknown request {request_id!r}")
        s = r.stream
        try:
            while True:
                await s.event.wait()
                s.event.clear()
                if not s.ids and not s.finished:
                    continue
                out = s.take(r)
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.get(request_id) is r and request_id not in self._reqs:
                del self._streams[request_id]

    async def abort(self, request_id: str) -> bool:
        r = self._reqs.get(request_id)
        if r is None:
            return False
        if request_id in self._running:
            self._release(r)
        else:
            self._waiting.remove(r)
            del self._reqs[request_id]
        self._stats.aborted += 1
        self._emit(r, None, "", "abort", True)
        return True

    def stats(self) -> EngineStats:
        s = self._stats
        s.waiting = len(self._waiting)
        s.running = len(self._running)
        s.kv_blocks_used = self.cache.used
        s.kv_blocks_cached = len(self.cache.refs)
        return s

    def kv_events(self) -> KvEventBatch:
        return self.cache.drain()

    def take_kv(self, request_id: str) -> bytes | None:
        return None  # simulated KV: the worker sends the cost model's byte count

    def put_kv(self, request_id: str, data: bytes) -> None:
        return None

    def kv_sink(self, request_id: str, nbytes: int) -> KvSink:
        return DroppedKv()  # the bytes crossed the wire; their content means nothing here

    # -- scheduling

    def _blocks_needed(self, req: EngineRequest) -> int:
        """Blocks for the whole sequence: a request that could never finish alone is refused at submit."""
        gen = 1 if req.phase == Phase.PREFILL else req.sampling.max_tokens
        return _blocks_for(len(req.prompt_tokens) + max(gen, 1), self.cfg.block_size)

    def _admit(self, r: _Req) -> bool:
        """Take r into the batch with blocks for what it must compute now plus one token; later blocks
        are allocated as it grows (`_grow`), preempting the newest request when the cache is full."""
        bs = self.cfg.block_size
        req = r.req
        hashes = req.block_hashes[: r.prompt_len // bs]
        hit = self.cache.hit_blocks(hashes)
        if not r.admitted and req.phase == Phase.DECODE:
            r.target = r.prompt_len + len(req.first_token_ids)
        need = _blocks_for(r.target + 1, bs) - hit
        for h in hashes[:hit]:
            self.cache.pin(h)  # before reserving, so that making room cannot evict the very prefix we hit
        if not self.cache.reserve(need):
            for h in hashes[:hit]:
                self.cache.unpin(h)
            return False
        r.pinned = list(hashes[:hit])
        r.blocks_reserved = need
        r.capacity = (hit + need) * bs
        if not r.admitted and req.phase == Phase.DECODE:
            # The KV of the prompt and first tokens landed from the prefill worker: nothing to compute,
            # and the prompt is a cached prefix here too.
            r.computed = r.target
            self._store_prompt_blocks(r)
            for t in req.first_token_ids:
                r.sampler.next()  # keep the stream aligned with an aggregated run
                r.comp.append(t)
        else:
            # At least the last token is computed: its logits give the next token.
            r.computed = min(hit * bs, r.target - 1)
            if not r.admitted:
                r.cached_tokens = r.computed
                self._stats.prompt_tokens_cached += r.computed
        r.admitted = True
        self._running[req.request_id] = r
        return True

    def _grow(self, r: _Req) -> bool:
        """Room for r's next token, preempting the newest requests if needed; False if r itself was."""
        while not self.cache.reserve(1):
            victim = next(reversed(self._running.values()))  # the newest, as vLLM does
            self._preempt(victim)
            if victim is r:
                return False
        r.blocks_reserved += 1
        r.capacity += self.cfg.block_size
        return True

    def _preempt(self, r: _Req) -> None:
        """Drop r's KV; it goes back to the front of the queue and recomputes prompt + generated tokens."""
        self._free_kv(r)
        del self._running[r.req.request_id]
        r.target = r.context
        r.computed = 0
        self._waiting.appendleft(r)
        self._stats.preempted += 1

    def _store_prompt_blocks(self, r: _Req) -> None:
        hashes = r.req.block_hashes[: r.prompt_len // self.cfg.block_size]
        for h in hashes[len(r.pinned):]:
            self.cache.store(h)
            r.pinned.append(h)
            r.blocks_reserved -= 1  # that block is now keyed by its hash (pinned) instead of private

    def _free_kv(self, r: _Req) -> None:
        """Unpin r's prefix blocks (they stay cached, evictable) and return its private blocks."""
        for h in r.pinned:
            self.cache.unpin(h)
        r.pinned = []
        self.cache.release(r.blocks_reserved)
        r.blocks_reserved = 0

    def _release(self, r: _Req) -> None:
        self._free_kv(r)
        self._running.pop(r.req.request_id, None)
        self._reqs.pop(r.req.request_id, None)

    def _emit(self, r: _Req, tok: int | None, text: str, reason: str | None, finished: bool) -> None:
        """Append to r's stream buffer; wake its consumer now for first tokens and ends, else at the next flush."""
        s = r.stream
        urgent = finished or (not s.index and not s.ids)
        if tok is not None:
            s.ids.append(tok)
        if text:
            s.parts.append(text)
        if finished:
            s.finished, s.finish_reason = True, reason
        if urgent:
            s.event.set()
            self._dirty.discard(r)
        else:
            self._dirty.add(r)

    def _flush(self) -> None:
        for r in self._dirty:
            r.stream.event.set()
        self._dirty.clear()

    def _plan(self) -> tuple[list[tuple[_Req, int]], list[_Req]]:
        """One continuous-batching step: every decoding request plus prefill chunks within the token budget."""
        prefills: list[tuple[_Req, int]] = []
        decodes: list[_Req] = []
        budget = self.cfg.max_batched_tokens
        running = self._running
        preempted_before = self._stats.preempted
        # Oldest first; a victim is always the newest, so it is never already in `decodes`.
        for r in list(running.values()):
            if r.computed < r.target or r.req.request_id not in running:
                continue
            # This step writes the KV of r's last token: grow by a block when that does not fit.
            if r.context > r.capacity and not self._grow(r):
                continue
            decodes.append(r)
        budget -= len(decodes)
        for r in running.values():
            if r.computed < r.target and budget > 0:
                n = min(r.target - r.computed, budget)
                prefills.append((r, n))
                budget -= n
        clean = self._stats.preempted == preempted_before
        # Admit in arrival order; a head that does not fit blocks the rest (no starvation of long prompts).
        # Not in a step that had to preempt: the cache is full, admitting now would only thrash.
        while clean and self._waiting and len(self._running) < self.cfg.max_batch:
            r = self._waiting[0]
            if not self._admit(r):
                break
            self._waiting.popleft()
            if r.queued_s < 0:
                r.queued_s = time.perf_counter() - r.submitted
            if r.computed >= r.target:
                if r.comp.finish_reason is not None:  # DECODE whose first tokens already ended it
                    self._finish(r, None, "")
                else:
                    decodes.append(r)
                    budget -= 1
            elif budget > 0:
                n = min(r.target - r.computed, budget)
                prefills.append((r, n))
                budget -= n
        return prefills, decodes

    def _finish(self, r: _Req, tok: int | None, text: str) -> None:
        self._release(r)
        self._emit(r, tok, text, r.comp.finish_reason, True)

    def _sample(self, r: _Req) -> bool:
        """Generate one token for r and emit it; True if r produced its first token."""
        first = not r.comp.token_ids
        tok = r.sampler.next()
        text = r.comp.append(tok)
        self._stats.tokens_generated += 1
        if r.comp.finish_reason is not None:
            self._finish(r, tok, text)
        elif r.req.phase == Phase.PREFILL:
            # Hand off: the decode worker continues once the KV has landed there.
            self._release(r)
            self._emit(r, tok, text, None, True)
        else:
            self._emit(r, tok, text, None, False)
        return first

    def _apply(self, prefills: list[tuple[_Req, int]], decodes: list[_Req]) -> bool:
        first = False
        for r, n in prefills:
            if r.req.request_id not in self._running:  # aborted while the step ran
                continue
            r.computed += n
            self._stats.prompt_tokens_computed += n
            if r.computed >= r.target:
                self._store_prompt_blocks(r)
                first |= self._sample(r)
        for r in decodes:
            if r.req.request_id in self._running:
                self._sample(r)
        return first

    async def _loop(self) -> None:
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Never leave a consumer waiting: every request ends with "error" and the engine refuses new work.
            log.exception("sim engine loop failed")
            self.failed = f"engine failed: {exc!r}"
            for r in list(self._reqs.values()):
                if r.req.request_id in self._running:
                    self._release(r)
                else:
                    self._reqs.pop(r.req.request_id, None)
                self._emit(r, None, "", "error", True)
            self._waiting.clear()

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        target = loop.time()  # simulated clock, in wall time
        last_yield = last_flush = target
        while True:
            if not self._running and not self._waiting:
                self._flush()
                self._wake.clear()
                await self._wake.wait()
                target = last_yield = loop.time()
                continue
            prefills, decodes = self._plan()
            if not prefills and not decodes:  # only DECODEs that ended on admission this round
                await asyncio.sleep(0)
                continue
            dt = self.timer.step_time([(n, r.computed) for r, n in prefills], [r.context for r in decodes])
            dt /= cfg.time_scale
            self._stats.steps += 1
            self._stats.busy_s += dt
            now = loop.time()
            target = max(target, now) + dt
            owed = target - now
            if owed > cfg.min_sleep_s:
                if now - last_flush >= cfg.stream_interval_s:
                    self._flush()
                    last_flush = now
                await asyncio.sleep(owed)
                last_yield = loop.time()
            first = self._apply(prefills, decodes)
            now = loop.time()
            if now - last_flush >= cfg.stream_interval_s:
                self._flush()
                last_flush = now
            # Yield promptly after a first token (TTFT) and at least every max_burst_s so that new work
            # and the consumers get the loop; consumers are only woken by first tokens, ends and flushes.
            if first:
                for _ in range(cfg.first_token_yields):
                    await asyncio.sleep(0)
                last_yield = loop.time()
            elif now - last_yield > cfg.max_burst_s:
                await asyncio.sleep(0)
                last_yield = loop.time()
