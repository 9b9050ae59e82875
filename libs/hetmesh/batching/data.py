"""The plain data the batching core (hetmesh.batching.core) schedules over: an engine's batching
`Settings`, one `Seq` per request, the `Step` the core picks and the `Outcome` of running it.

Plain classes with __slots__ rather than Structs where the core creates or touches them on every
step (`Seq`, `Step`, `Outcome`): the simulator makes millions of them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from enum import IntEnum

from msgspec import Struct

PREFILL_ORDERS = ("fcfs", "shortest")


class Kind(IntEnum):
    FULL = 0  # prefill and decode here
    PREFILL = 1  # prefill, sample the first token, hand off (P/D)
    DECODE = 2  # the prompt's KV (and the first tokens) landed from a prefill worker


class State(IntEnum):
    WAITING = 0
    PREFILLING = 1
    DECODING = 2
    DONE = 3


_WAITING = State.WAITING  # a module name: cheaper than the member lookup, once per Seq


class Settings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine's batching settings; the cluster file's worker group fills them (hetmesh.wiring)."""

    max_batch: int = 64  # sequences in the running batch
    kv_blocks: int = 4096
    block_size: int = 16  # tokens per KV block
    step_tokens: int = 8192  # one step's token budget: prefill chunk tokens + one per decoding sequence
    prefill_order: str = "fcfs"  # fcfs | shortest (fewest uncached prompt tokens first)
    hash_blocks: int = 1  # KV blocks per prefix hash (the simulator's trace hashes cover several)
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if min(self.max_batch, self.kv_blocks, self.block_size, self.hash_blocks) < 1:
            raise ValueError("max_batch, kv_blocks, block_size and hash_blocks must be >= 1")
        if self.step_tokens < self.max_batch:
            raise ValueError(f"step_tokens ({self.step_tokens}) must be >= max_batch ({self.max_batch}): "
                             "every decoding sequence takes a token of the step")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, not {self.prefill_order!r}")


def following(step: Step, j: int) -> Step:
    """The j-th plain decode step after `step` (`Core.quiet`): the same batch, every context j tokens longer."""
    nxt = Step(step.tick + j)
    nxt.n_decode = step.n_decode
    nxt.decode_context = step.decode_context + step.n_decode * j
    return nxt


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Seq:
    """One sequence's bookkeeping in the core. `generated` and `context` of a decoding sequence
    are read through `Core.generated` (they advance with the step counter)."""

    __slots__ = ("active", "adm", "admitted", "admitted_at", "cached_tokens", "capacity", "computed", "d0", "f", "g0",
                 "generated", "hashes", "kind", "max_new", "n_first", "npinned", "order", "priority", "private", "prompt_len",
                 "rid", "state", "target", "uncached", "ver")

    def __init__(self, rid: Hashable, kind: Kind, prompt_len: int, hashes: Sequence[int], max_new: int,
                 n_first: int = 0, priority: int = 0) -> None:
        self.rid = rid
        self.priority = priority  # vLLM's request priority: lower is served first; 0 for most
        self.order = 0  # arrival number among the queued with a priority other than 0
        self.kind = kind
        self.prompt_len = prompt_len
        self.hashes = hashes  # hashes of the prompt's full hash blocks, in order
        self.max_new = max_new  # generated tokens at which the sequence ends ("length")
        self.n_first = n_first  # DECODE: tokens the prefill side generated
        self.state = _WAITING
        self.target = prompt_len  # tokens whose KV must be present before the next sample
        self.computed = 0  # of those, the ones whose KV is present
        self.generated = n_first  # materialised while not decoding
        self.cached_tokens = 0
        self.admitted = False
        self.admitted_at = -1.0
        self.capacity = 0  # tokens the blocks it holds can store
        self.npinned = 0  # leading hashes it holds a pin on
        self.private = 0  # blocks it holds that are not keyed by a hash
        self.adm = 0  # admission number (the running batch's order; preemption takes the newest)
        self.ver = 0  # bumped whenever its heap entries go stale
        self.d0 = 0  # step at which it joined decoding, with g0 tokens generated
        self.g0 = 0
        self.f = 0  # decoding: the first step at which it needs a new block (then every block_size steps)
        self.active = False  # decoding and past f: counted in Core._growing
        self.uncached = prompt_len


EMPTY: list = []  # a shared empty list, never appended to: most steps admit and end nothing


class Step:
    """What one engine step runs."""

    __slots__ = ("admitted", "decode_context", "decodes", "ended", "n_decode", "prefill_cached", "prefill_pairs",
                 "prefill_seqs", "prefill_tokens", "prefills", "tick")

    def __init__(self, tick: int) -> None:
        self.tick = tick
        self.prefills: list[tuple[Seq, int, int]] = EMPTY  # (seq, new tokens, tokens already in KV)
        self.decodes: list[Seq] | None = None  # the decoding sequences (when the core tracks them)
        self.n_decode = 0
        self.decode_context = 0  # sum of the decoding sequences' contexts
        self.prefill_tokens = 0
        self.prefill_seqs = 0
        self.prefill_pairs = 0  # causal attention (query, key) pairs of the chunks
        self.prefill_cached = 0  # KV tokens the chunks read
        self.admitted: list[Seq] = EMPTY  # first admissions this step
        self.ended: list[Seq] = EMPTY  # DECODEs whose first tokens already ended them, finished on admission

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.n_decode

    def signature(self) -> tuple[object, ...]:
        """The step as comparable data: chunks, decode batch, admissions."""
        return (tuple((s.rid, n, c) for s, n, c in self.prefills), self.n_decode, self.decode_context,
                tuple(s.rid for s in self.admitted))


class Outcome:
    __slots__ = ("finished", "sampled")

    def __init__(self, sampled: list[Seq] = EMPTY, finished: list[Seq] = EMPTY) -> None:
        self.sampled = sampled  # completed a prefill (or a recompute) and sampled a token
        self.finished = finished  # ended this step: by length, or a PREFILL handed off


class CoreStats:
    __slots__ = ("preempted", "prompt_tokens_cached", "prompt_tokens_computed", "steps", "tokens_generated")

    def __init__(self) -> None:
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.preempted = 0
        self.steps = 0
