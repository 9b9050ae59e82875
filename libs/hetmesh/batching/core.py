"""The batching core: one continuous-batching engine as plain data, no clock, no I/O.

Shaped like vLLM v1's scheduler: `schedule(now) -> Step` picks what the next engine step runs (every
decoding sequence plus prefill chunks under one token budget, while batch slots and KV blocks last);
`update(step) -> Outcome` applies the step once it has run. The live `sim` engine and the offline
simulator both run this code. Decoding sequences advance lazily (a sequence's length is a function of the
step counter, touched only when it needs a KV block or ends), so a step is O(events), not O(batch).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from heapq import heappop, heappush

from hetmesh.batching.cache import PrefixCache
from hetmesh.batching.data import (
    EMPTY,
    CoreStats,
    Kind,
    Outcome,
    Seq,
    Settings,
    State,
    Step,
    blocks_for,
    following,
)

# The members as module names: an enum member's lookup costs several times a global's, on every step.
_FULL, _PREFILL, _DECODE = Kind
_WAITING, _PREFILLING, _DECODING, _DONE = State
_QUIET = Outcome()  # shared, never appended to


def _next_key(keys: list[int], lo: int) -> float:
    """The smallest step >= lo in a heap of bucket steps (steps below lo are past: dropped)."""
    while keys and keys[0] < lo:
        heappop(keys)
    return keys[0] if keys else float("inf")


class Core:
    def __init__(self, settings: Settings, track_decodes: bool = True) -> None:
        self.s = settings
        self.cache = PrefixCache(settings.kv_blocks, settings.hash_blocks)
        self.track = track_decodes  # Step.decodes listed (the live engine samples each); the simulator needs counts
        self.seqs: dict[Hashable, Seq] = {}  # waiting or running
        self.running: dict[Hashable, Seq] = {}  # admission order
        self.prefilling: dict[Hashable, Seq] = {}
        self.decoding: dict[Hashable, Seq] = {}
        self._resumed: deque[Seq] = deque()  # preempted: first in line
        self._fifo: deque[Seq] = deque()
        self._short: list[tuple[int, int, Seq]] = []  # prefill_order "shortest"
        # vLLM's priority scheduling: a sequence with a priority other than 0 waits in this heap by (priority,
        # arrival), ahead of the priority-0 queues if below 0, behind them if above; a preempted one comes back
        # here by its arrival. Preemption then takes the running sequence of the highest priority value (the
        # newest among equals), as vLLM's does.
        self._prio: list[tuple[int, int, Seq]] = []
        self._prioritised = False  # any sequence with a priority other than 0 ever added
        self.n_waiting = 0
        # step -> [(ver, seq)]: decodes that need their first new block at that step / reach max_new in it
        # (stale when the seq's ver moved on). Every step is scheduled once in order, so buckets beat a heap.
        self._first_at: dict[int, list[tuple[int, Seq]]] = {}
        self._end_at: dict[int, list[tuple[int, Seq]]] = {}
        self._first_keys: list[int] = []  # heaps of those buckets' steps, for `quiet`
        self._end_keys: list[int] = []
        # A decode needs a block every block_size steps from its f on, so the blocks step t needs are the
        # decodes with f = t (mod block_size): counted per residue, never visited one by one while memory
        # lasts. A decode's blocks are then cap0 + one per crossing up to _crossed (the last step whose
        # growth is reserved), worked out when it leaves decoding.
        self._growing = [0] * settings.block_size
        self._crossed = -1
        self._ctx_base = 0  # sum over decoding seqs of (context - step), so contexts sum to this + n * tick
        self.tick = 0
        self._adm = 0
        self._arrivals = 0
        self.stats = CoreStats()
        self._hash_tokens = settings.block_size * settings.hash_blocks

    # ------------------------------------------------------------------ requests in and out
    def blocks_needed(self, prompt_len: int, kind: Kind, max_new: int) -> int:
        """Blocks for the whole sequence alone: more than the engine has means it can never finish."""
        gen = 1 if kind == _PREFILL else max_new
        return blocks_for(prompt_len + max(gen, 1), self.s.block_size)

    def add(self, seq: Seq) -> None:
        if seq.rid in self.seqs:
            raise ValueError(f"request {seq.rid!r} is already in this engine")
        if seq.prompt_len < 1:
            raise ValueError("empty prompt")
        need = self.blocks_needed(seq.prompt_len, seq.kind, seq.max_new)
        if need > self.s.kv_blocks:
            raise ValueError(f"request needs {need} KV blocks; this engine has {self.s.kv_blocks}")
        full = seq.prompt_len // self._hash_tokens
        if len(seq.hashes) > full:
            seq.hashes = seq.hashes[:full]
        self.seqs[seq.rid] = seq
        self.n_waiting += 1
        if seq.priority:
            self._prioritised = True
            self._arrivals += 1
            seq.order = self._arrivals
            heappush(self._prio, (seq.priority, seq.order, seq))
        elif self.s.prefill_order == "shortest":
            hit = self.cache.hit(seq.hashes) if self.s.prefix_caching else 0
            seq.uncached = seq.prompt_len - hit * self._hash_tokens
            self._arrivals += 1
            heappush(self._short, (seq.uncached, self._arrivals, seq))
        else:
            self._fifo.append(seq)

    def abort(self, rid: Hashable) -> Seq | None:
        s = self.seqs.get(rid)
        if s is None:
            return None
        if s.state == _WAITING:
            self.n_waiting -= 1  # its queue entry is skipped when it comes up
            self._done(s)
        else:
            self._finish(s)
        return s

    def finish(self, rid: Hashable) -> Seq | None:
        """The shell ended a running sequence early (a stop string, EOS): free it now."""
        s = self.seqs.get(rid)
        if s is not None and s.state != _WAITING:
            self._finish(s)
        return s

    def generated(self, s: Seq) -> int:
        return s.g0 + self.tick - s.d0 if s.state == _DECODING else s.generated

    @property
    def idle(self) -> bool:
        return not self.seqs

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float = 0.0) -> Step:
        t = self.tick
        step = Step(t)
        admit = True
        if self._crossed < t:  # once per step: the blocks of the decodes that cross a block boundary now
            preempted = self.stats.preempted
            self._grow(t)
            admit = self.stats.preempted == preempted  # a step that had to preempt admits nothing: it would thrash
        s_ = self.s
        n_dec = len(self.decoding)
        budget = s_.step_tokens - n_dec
        for s in self.prefilling.values():
            if budget <= 0:
                break
            budget -= self._chunk(step, s, budget)
        if admit:
            while self.n_waiting and len(self.running) < s_.max_batch:
                s = self._head()
                first = s is not None and not s.admitted
                if s is None or not self._admit(s, now):
                    break
                self._pop_head(s)
                if first:
                    if step.admitted is EMPTY:
                        step.admitted = []
                    step.admitted.append(s)
                if s.state == _DONE:
                    if step.ended is EMPTY:
                        step.ended = []
                    step.ended.append(s)
                elif s.state == _DECODING:
                    n_dec += 1
                    budget -= 1
                elif budget > 0:
                    budget -= self._chunk(step, s, budget)
        step.n_decode = n_dec
        step.decode_context = self._ctx_base + n_dec * t
        if self.track:
            step.decodes = list(self.decoding.values())
        return step

    def update(self, step: Step) -> Outcome:
        """Apply a step that ran: prompt KV stored, tokens counted, sequences ended."""
        t = step.tick
        st = self.stats
        st.steps += 1
        st.tokens_generated += len(self.decoding)
        self.tick = t + 1
        ends = self._end_at.pop(t, None)  # (joining decodes end at t + 1 or later)
        prefills = step.prefills
        if ends is None and not prefills:
            return _QUIET  # most steps: nothing sampled, nothing ended
        sampled: list[Seq] = []
        finished: list[Seq] = []
        for s, n, _ in prefills:
            if s.state != _PREFILLING:  # aborted while the step ran
                continue
            s.computed += n
            st.prompt_tokens_computed += n
            if s.computed < s.target:
                continue
            self._store_prompt(s)
            s.generated += 1
            st.tokens_generated += 1
            sampled.append(s)
            del self.prefilling[s.rid]
            if s.kind == _PREFILL or s.generated >= s.max_new:
                self._finish(s)
                finished.append(s)
            else:
                self._join_decoding(s, t + 1)
        if ends is not None:
            for ver, s in ends:
                if s.ver == ver:
                    self._finish(s)
                    finished.append(s)
        return Outcome(sampled, finished)

    # ------------------------------------------------------------------ runs of plain decode steps
    def quiet(self, step: Step, limit: int) -> int:
        """How many steps after `step` (just scheduled) are plain decode steps if nothing is added or
        aborted meanwhile: nothing queued or prefilling, no sequence ends before the last of them, none
        starts growing, and their blocks fit without eviction. A simulator may then run them as one
        event (`skip`); the steps are the same."""
        if step.prefills or step.ended or self.prefilling or self.n_waiting or not self.decoding:
            return 0
        t = step.tick
        kmax = min(limit, _next_key(self._end_keys, t) - t, _next_key(self._first_keys, t + 1) - t - 1)
        cache, growing, bs = self.cache, self._growing, self.s.block_size
        free = cache.total - len(cache.refs) * cache.unit - cache.private
        if kmax <= 0 or free < 0:
            return 0
        g = sum(growing)  # blocks any block_size steps in a row take: whole rounds first, then step by step
        if not g:
            return kmax
        rounds = min(kmax // bs, free // g)
        k, free = rounds * bs, free - rounds * g
        while k < kmax:
            free -= growing[(t + k + 1) % bs]
            if free < 0:
                break
            k += 1
        return k

    def skip(self, step: Step, k: int) -> Outcome:
        """`update(step)`, then the next k plain decode steps (`quiet`) as schedule + update would run them."""
        out = self.update(step)
        if not k:
            return out
        t, n = step.tick, step.n_decode
        growing, bs = self._growing, self.s.block_size
        rounds, rest = divmod(k, bs)  # the blocks of steps t+1 .. t+k: whole rounds of residues, then the rest
        self.cache.private += rounds * sum(growing) + sum(growing[j % bs] for j in range(t + 1, t + rest + 1))
        self._crossed = t + k
        st = self.stats
        st.steps += k - 1
        st.tokens_generated += (k - 1) * n
        self.tick = t + k
        return self.update(following(step, k))  # no sequence ended before its last step: update(step) ended none

    # ------------------------------------------------------------------ internals
    def _head(self) -> Seq | None:
        p = self._prio
        while p and p[0][2].state != _WAITING:
            heappop(p)  # aborted while queued
        if p and p[0][0] < 0:
            return p[0][2]
        q = self._resumed
        while q and q[0].state != _WAITING:
            q.popleft()
        if q:
            return q[0]
        q = self._fifo
        while q and q[0].state != _WAITING:
            q.popleft()
        if q:
            return q[0]
        h = self._short
        while h and h[0][2].state != _WAITING:
            heappop(h)
        if h:
            return h[0][2]
        return p[0][2] if p else None

    def _pop_head(self, s: Seq) -> None:
        self.n_waiting -= 1
        if self._prio and self._prio[0][2] is s:
            heappop(self._prio)
        elif self._resumed and self._resumed[0] is s:
            self._resumed.popleft()
        elif self._fifo and self._fifo[0] is s:
            self._fifo.popleft()
        else:
            heappop(self._short)

    def _chunk(self, step: Step, s: Seq, budget: int) -> int:
        n = min(s.target - s.computed, budget)
        c = s.computed
        if step.prefills is EMPTY:
            step.prefills = []
        step.prefills.append((s, n, c))
        step.prefill_tokens += n
        step.prefill_seqs += 1
        step.prefill_pairs += n * c + n * (n + 1) // 2
        step.prefill_cached += c
        return n

    def _admit(self, s: Seq, now: float) -> bool:
        """Take s into the batch with blocks for what it must compute now plus one token; later blocks
        come as it grows, preempting the newest sequence when the cache is full."""
        s_ = self.s
        cache = self.cache
        hashes = s.hashes
        hit = cache.hit(hashes) if s_.prefix_caching else 0
        first = not s.admitted
        if first and s.kind == _DECODE:
            s.target = s.prompt_len + s.n_first
        need = -(-(s.target + 1) // s_.block_size) - hit * s_.hash_blocks  # blocks_for
        cache.pin(hashes, hit)  # before reserving, so that making room cannot evict the prefix we hit
        if not cache.reserve(need):
            cache.unpin(hashes, hit)
            return False
        s.npinned = hit
        s.private = need
        s.capacity = (hit * s_.hash_blocks + need) * s_.block_size
        self._adm += 1
        s.adm = self._adm
        self.running[s.rid] = s
        s.admitted = True
        if first:
            s.admitted_at = now
        if first and s.kind == _DECODE:
            # The KV of the prompt and first tokens landed: nothing to compute, and the prompt is a
            # cached prefix here too.
            s.computed = s.target
            self._store_prompt(s)
            if s.generated >= s.max_new:
                self._finish(s)
            else:
                self._join_decoding(s, self.tick)
        else:
            s.computed = min(hit * self._hash_tokens, s.target - 1)  # the last token's logits give the next
            if first:
                s.cached_tokens = s.computed
                self.stats.prompt_tokens_cached += s.computed
            s.state = _PREFILLING
            self.prefilling[s.rid] = s
        return True

    def _join_decoding(self, s: Seq, d0: int) -> None:
        s.state = _DECODING
        s.d0, s.g0 = d0, s.generated
        ctx = s.prompt_len + s.generated
        self._ctx_base += ctx - d0
        self.decoding[s.rid] = s
        s.ver += 1
        s.f = d0 + s.capacity - ctx + 1
        s.active = False
        self._at(self._first_at, self._first_keys, s.f, s)
        self._at(self._end_at, self._end_keys, d0 + s.max_new - s.g0 - 1, s)

    @staticmethod
    def _at(buckets: dict[int, list[tuple[int, Seq]]], keys: list[int], step: int, s: Seq) -> None:
        b = buckets.get(step)
        if b is None:
            buckets[step] = [(s.ver, s)]
            heappush(keys, step)
        else:
            b.append((s.ver, s))

    def _leave_decoding(self, s: Seq) -> None:
        s.generated = s.g0 + self.tick - s.d0
        self._ctx_base -= s.prompt_len + s.g0 - s.d0
        del self.decoding[s.rid]
        if s.active:  # the blocks it grew by
            bs = self.s.block_size
            k = (self._crossed - s.f) // bs + 1
            s.private += k
            s.capacity += k * bs
            self._growing[s.f % bs] -= 1
            s.active = False
        s.ver += 1

    def _grow(self, t: int) -> None:
        bs = self.s.block_size
        r = t % bs
        for ver, s in self._first_at.pop(t, ()):
            if s.ver == ver:
                s.active = True
                self._growing[r] += 1
        n = self._growing[r]
        cache = self.cache
        if cache.total - len(cache.refs) * cache.unit - cache.private >= n:  # room for all: nothing to evict
            cache.private += n
            self._crossed = t
            return
        # Short of memory: block by block, the last to be preempted first; preemption takes the newest (of the
        # highest priority value), maybe the grower, never one served before it in this loop (its block is taken).
        self._crossed = t - 1
        growers = sorted((s for s in self.decoding.values() if s.active and s.f % bs == r),
                         key=lambda s: (s.priority, s.adm))
        for s in growers:
            if s.state != _DECODING:
                continue  # preempted by an older one's growth
            while not cache.reserve(1):
                victim = (max(self.running.values(), key=lambda v: (v.priority, v.adm)) if self._prioritised
                          else next(reversed(self.running.values())))
                self._preempt(victim)
                if victim is s:
                    break
        self._crossed = t

    def _preempt(self, s: Seq) -> None:
        """Drop s's KV; it goes to the front of the queue and recomputes prompt + generated tokens."""
        self._free(s)
        s.target = s.prompt_len + s.generated
        s.computed = 0
        s.state = _WAITING
        self.n_waiting += 1
        if s.priority:
            heappush(self._prio, (s.priority, s.order, s))
        else:
            self._resumed.appendleft(s)
        self.stats.preempted += 1

    def _store_prompt(self, s: Seq) -> None:
        hashes = s.hashes
        self.cache.store(hashes, s.npinned)
        s.private -= (len(hashes) - s.npinned) * self.s.hash_blocks  # now keyed by their hashes (pinned)
        s.npinned = len(hashes)

    def _free(self, s: Seq) -> None:
        """Unpin s's prefix (it stays cached, evictable), return its private blocks, leave the batch."""
        if s.state == _DECODING:
            self._leave_decoding(s)
        else:
            self.prefilling.pop(s.rid, None)
        cache = self.cache
        if s.npinned:
            cache.unpin(s.hashes, s.npinned)
            s.npinned = 0
        cache.release(s.private)
        s.private = 0
        self.running.pop(s.rid, None)

    def _finish(self, s: Seq) -> None:
        self._free(s)
        s.state = _DONE  # _done, inline: every request ends here
        s.ver += 1
        self.seqs.pop(s.rid, None)

    def _done(self, s: Seq) -> None:
        s.state = _DONE
        s.ver += 1
        self.seqs.pop(s.rid, None)
