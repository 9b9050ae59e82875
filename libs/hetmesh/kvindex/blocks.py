"""Chained prefix-block hashes: block i's hash covers every token of blocks 0..i.

Only full blocks are hashed (a partial block is never shared). Chaining means two prompts
share block i's hash exactly when they share their first (i+1)*block_size tokens, so a
prefix match is a walk from block 0 that stops at the first miss. The model name seeds the
chain so that equal tokens under different models never collide.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Sequence
from functools import lru_cache
from hashlib import blake2b

_MASK63 = (1 << 63) - 1  # keep hashes positive and inside a signed 64-bit int (JSON, Redis)


@lru_cache(maxsize=256)
def _seed(model: str) -> bytes:
    return blake2b(model.encode(), digest_size=8).digest()


def block_hashes(model: str, tokens: Sequence[int], block_size: int) -> list[int]:
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[int] = []
    full = len(tokens) - len(tokens) % block_size
    if not full:
        return out
    prev = _seed(model)
    # One conversion for the whole prompt, then zero-copy slices: same bytes per block as
    # array("q", block).tobytes(), a fraction of the gateway's per-request cost.
    raw = memoryview(array("q", tokens[:full]).tobytes())
    step = block_size * 8
    for start in range(0, full * 8, step):
        prev = blake2b(prev + raw[start : start + step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") & _MASK63)
    return out


def next_block(model: str, parent: bytes | None, block: Sequence[int]) -> bytes:
    """One step of the chain: the digest of `block` after the block whose digest is `parent` (None:
    the first block). For engines that report their cache block by block (vLLM's KV events);
    `digest_int` of the result equals the matching entry of `block_hashes`."""
    return blake2b((parent or _seed(model)) + array("q", block).tobytes(), digest_size=8).digest()


def digest_int(digest: bytes) -> int:
    return int.from_bytes(digest, "little") & _MASK63


def cached_prefix_blocks(hashes: Sequence[int], has: Callable[[int], bool]) -> int:
    """Number of leading blocks for which `has` is true (the usable prefix hit)."""
    n = 0
    for h in hashes:
        if not has(h):
            break
        n += 1
    return n


def leading_blocks(hashes: Sequence[int], holders: Callable[[int], Collection[str] | None]) -> dict[str, int]:
    """Leading blocks each worker holds: the prefix index lookup. A worker counts while it holds every
    block so far; the walk stops at the first block nobody still in the running holds. The Redis
    index runs this same walk in Lua (hetmesh.kvindex.index; a property test keeps them equal)."""
    out: dict[str, int] = {}
    alive: set[str] | None = None
    for n, h in enumerate(hashes, 1):
        held = holders(h)
        if not held:
            break
        present = set(held) if alive is None else alive.intersection(held)
        if not present:
            break
        alive = present
        for w in alive:
            out[w] = n
    return out
