"""KV memory of one engine: fixed-size blocks, a block-hash prefix cache with refcounts and LRU.

A cached entry is one hashed run of prompt tokens (`unit` memory blocks: 1 where the hash
block is the engine's block, as in the live mesh; a trace's coarser hash blocks in the
simulator). `private` counts blocks held by running sequences that are not keyed by a hash:
the partial tail, generated tokens, and prompt blocks still being computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from msgspec import Struct, field

from hetmesh.kvindex.blocks import cached_prefix_blocks


class KvEventBatch(Struct, kw_only=True):
    """Net change of the prefix cache since the last drain (a block stored then evicted cancels out)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


class PrefixCache:
    def __init__(self, total_blocks: int, unit: int = 1) -> None:
        self.total = total_blocks
        self.unit = unit  # memory blocks per cached hash
        self.refs: dict[int, int] = {}  # every cached hash -> pin count
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned cached hashes, oldest first
        self.private = 0
        self._pending: dict[int, bool] = {}  # hash -> stored (True) / removed (False), net since drain
        self.cleared = False
        self.dirty = False  # events wait to be drained

    @property
    def free(self) -> int:
        return self.total - len(self.refs) * self.unit - self.private

    @property
    def used(self) -> int:
        """Blocks that cannot be reclaimed right now."""
        return self.total - self.free - len(self.lru) * self.unit

    @property
    def cached_blocks(self) -> int:
        return len(self.refs) * self.unit

    def hit(self, hashes: Sequence[int]) -> int:
        """Leading hashes held (the usable prefix)."""
        return cached_prefix_blocks(hashes, self.refs.__contains__)

    def pin(self, hashes: Sequence[int], n: int) -> None:
        """Pin the first n of `hashes` (cached): they cannot be evicted until unpinned."""
        refs, lru = self.refs, self.lru
        for i in range(n):
            h = hashes[i]
            c = refs[h]
            if c == 0:
                del lru[h]
            refs[h] = c + 1

    def unpin(self, hashes: Sequence[int], n: int) -> None:
        refs, lru = self.refs, self.lru
        for i in range(n):
            h = hashes[i]
            c = refs[h] - 1
            refs[h] = c
            if c == 0:
                lru[h] = None  # most recently used end

    def reserve(self, n: int) -> bool:
        """Take n private blocks, evicting least recently used prefixes if needed."""
        refs, lru, unit = self.refs, self.lru, self.unit
        free = self.total - len(refs) * unit - self.private  # self.free
        if free + len(lru) * unit < n:
            return False
        while free < n:
            h, _ = lru.popitem(last=False)
            del refs[h]
            self._note(h, False)
            free += unit
        self.private += n
        return True

    def release(self, n: int) -> None:
        self.private -= n

    def store(self, hashes: Sequence[int], start: int) -> None:
        """Turn `unit` private blocks per hash of hashes[start:] into cached, pinned entries (an entry cached
        already is pinned instead, the blocks dropped)."""
        refs, lru, unit = self.refs, self.lru, self.unit
        for i in range(start, len(hashes)):
            h = hashes[i]
            self.private -= unit
            c = refs.get(h)
            if c is None:
                refs[h] = 1
                self._note(h, True)
            else:
                if c == 0:
                    del lru[h]
                refs[h] = c + 1

    def _note(self, h: int, stored: bool) -> None:
        # Net effect only: stored-then-evicted within one drain window need not reach the index.
        if self._pending.pop(h, None) is None or stored:
            self._pending[h] = stored
        self.dirty = True

    def clear_all(self) -> None:
        """Announce a fresh, empty cache (engine start): the index drops what it held for us."""
        self.cleared = self.dirty = True

    def take(self) -> dict[int, bool]:
        """The net events since the last take, hash -> stored (True) / removed (False), as they are (the
        simulator's index reads them per arrival; `drain` wraps them for the bus)."""
        p = self._pending
        self._pending = {}
        self.dirty = False
        return p

    def drain(self) -> KvEventBatch:
        p = self.take()
        batch = KvEventBatch(stored=[h for h, s in p.items() if s], removed=[h for h, s in p.items() if not s],
                             cleared=self.cleared)
        self.cleared = False
        return batch
