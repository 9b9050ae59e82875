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
        if self.free + len(self.lru) * self.unit < n:
            return False
        while self.free < n:
            h, _ = self.lru.popitem(last=False)
            del self.refs[h]
            self._note(h, False)
        self.private += n
        return True

    def release(self, n: int) -> None:
        self.private -= n

    def store(self, h: int) -> None:
        """Turn `unit` private blocks into the cached, pinned entry `h` (dropped if `h` was cached already)."""
        self.private -= self.unit
        if h in self.refs:
            self.pin(h)
            return
        self.refs[h] = 1
        self._note(h, True)

    def _note(self, h: int, stored: bool) -> None:
        # Net effect only: stored-then-evicted within one drain window need not reach the index.
        if self._pending.pop(h, None) is None or stored:
            self._pending[h] = stored
        self.dirty = True

    def clear_all(self) -> None:
        """Announce a fresh, empty cache (engine start): the index drops what it held for us."""
        self.cleared = self.dirty = True

    def drain(self) -> KvEventBatch:
        p = self._pending
        batch = KvEventBatch(stored=[h for h, s in p.items() if s], removed=[h for h, s in p.items() if not s],
                             cleared=self.cleared)
        p.clear()
        self.cleared = self.dirty = False
        return batch
