"""Prefix-block hashing (the one scheme of the mesh) and the Redis prefix index."""

from hetmesh.kvindex.blocks import block_hashes, cached_prefix_blocks

__all__ = ["block_hashes", "cached_prefix_blocks"]
