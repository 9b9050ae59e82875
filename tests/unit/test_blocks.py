from hypothesis import given
from hypothesis import strategies as st

from hetmesh.kvindex.blocks import block_hashes, cached_prefix_blocks, digest_int, next_block

tokens = st.lists(st.integers(0, 2**31 - 1), max_size=200)


@given(tokens, tokens, st.integers(1, 32))
def test_shared_hashes_iff_shared_prefix(a: list[int], b: list[int], bs: int) -> None:
    ha, hb = block_hashes("m", a, bs), block_hashes("m", b, bs)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: (i + 1) * bs] == b[: (i + 1) * bs]
        assert (ha[i] == hb[i]) == same_prefix


@given(tokens, st.integers(1, 32))
def test_only_full_blocks_and_positive(a: list[int], bs: int) -> None:
    h = block_hashes("m", a, bs)
    assert len(h) == len(a) // bs
    assert all(0 <= x < 2**63 for x in h)


def test_model_seeds_the_chain() -> None:
    t = list(range(64))
    assert block_hashes("a", t, 16) != block_hashes("b", t, 16)
    assert block_hashes("a", t, 16) == block_hashes("a", t, 16)


def test_cached_prefix_stops_at_first_miss() -> None:
    held = {1, 2, 4}
    assert cached_prefix_blocks([1, 2, 3, 4], held.__contains__) == 2
    assert cached_prefix_blocks([3, 1], held.__contains__) == 0


@given(st.lists(st.integers(0, 50_000), max_size=200), st.integers(1, 32))
def test_block_by_block_chain_equals_block_hashes(a: list[int], bs: int) -> None:
    # The vLLM engine maps its KV events onto the mesh's scheme one block at a time.
    parent = None
    chained = []
    for i in range(len(a) // bs):
        parent = next_block("m", parent, a[i * bs : (i + 1) * bs])
        chained.append(digest_int(parent))
    assert chained == block_hashes("m", a, bs)
