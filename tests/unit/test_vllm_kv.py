"""The TP pairing rule of our KV connector (hetmesh.engines.vllm_kv) against the cluster files: pure, no vLLM."""

from __future__ import annotations

from pathlib import Path

from hetmesh import config
from hetmesh.costmodel import model_spec
from hetmesh.engines import _peer_tp_sizes, _tp
from hetmesh.engines.vllm_kv import shard_sources, tp_pairing_problem

PRODUCTION = Path(__file__).parents[2] / "ops/k8s/overlays/production/cluster.toml"


def test_the_production_overlays_tp_pairings_are_all_allowed() -> None:
    cfg = config.load(PRODUCTION)
    for g in cfg.workers:
        heads = model_spec(cfg.model(g.model).spec).kv_heads
        peers = _peer_tp_sizes(cfg, g)
        assert len(peers) == len(cfg.workers) - 1
        assert all(tp_pairing_problem(_tp(g), p, heads) is None for p in peers), (g.name, peers)
    # A TP 4 decode server takes an 8-way prefill's heads two shards at a time.
    assert shard_sources(1, 4, 8, 8) == [(2, 0, 1), (3, 0, 1)]


def test_replicated_heads_need_equal_tp() -> None:
    assert tp_pairing_problem(16, 8, 8) is not None  # TP 16 over 8 KV heads: each head on two ranks
    assert tp_pairing_problem(16, 16, 8) is None
    assert shard_sources(0, 2, 1, 8) == [(0, 0, 4)] and shard_sources(1, 2, 1, 8) == [(0, 4, 4)]
