"""The worker's Prometheus rows, read at scrape time from the engine's stats and the worker's own counters."""

from __future__ import annotations

from hetmesh import metrics
from hetmesh.engines.base import EngineStats


def rows(s: EngineStats, kv_waiting: int, kv_sent: int, kv_received: int, kv_unclaimed: int) -> list[metrics.Row]:
    """`kv_waiting`: requests waiting for their KV; `kv_sent` / `kv_received`: KV bytes shipped and landed;
    `kv_unclaimed`: transfers landed that no decode has taken yet."""
    g: dict[str, str] = {}  # no labels: Prometheus adds the target
    return [
        ("hetmesh_worker_queue_depth", "Requests waiting: in the engine's queue or for their KV", "gauge", g,
         s.waiting + kv_waiting),
        ("hetmesh_worker_running_requests", "Requests in the running batch", "gauge", g, s.running),
        ("hetmesh_worker_max_batch", "Running batch limit", "gauge", g, s.max_batch),
        ("hetmesh_worker_kv_blocks_used", "KV blocks pinned by running requests", "gauge", g, s.kv_blocks_used),
        ("hetmesh_worker_kv_blocks_cached", "KV blocks holding a prefix", "gauge", g, s.kv_blocks_cached),
        ("hetmesh_worker_kv_blocks_total", "KV blocks of the engine", "gauge", g, s.kv_blocks_total),
        ("hetmesh_worker_generated_tokens", "Tokens generated", "counter", g, s.tokens_generated),
        # Prefix hit rate: rate(prompt_cached) / (rate(prompt_cached) + rate(prompt_computed)).
        ("hetmesh_worker_prompt_tokens_computed", "Prompt tokens prefilled", "counter", g, s.prompt_tokens_computed),
        ("hetmesh_worker_prompt_tokens_cached", "Prompt tokens served from the prefix cache", "counter", g,
         s.prompt_tokens_cached),
        ("hetmesh_worker_preempted_requests", "Requests whose KV was dropped to make room", "counter", g, s.preempted),
        ("hetmesh_worker_aborted_requests", "Requests aborted in the engine", "counter", g, s.aborted),
        ("hetmesh_worker_kv_transfer_sent_bytes", "KV bytes shipped to decode workers", "counter", g, kv_sent),
        ("hetmesh_worker_kv_transfer_received_bytes", "KV bytes landed from prefill workers", "counter", g,
         kv_received),
        ("hetmesh_worker_kv_landed_unclaimed", "Transfers landed here that no decode has taken yet", "gauge", g,
         kv_unclaimed),
    ]
