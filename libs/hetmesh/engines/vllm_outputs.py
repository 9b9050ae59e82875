"""What vLLM reports, in the mesh's terms, for the `vllm` engine (hetmesh.engines.vllm_engine): a
token's logprobs, the scheduler stats vLLM's stat logger hands over each iteration, and its KV-cache
events mapped onto the mesh's one block-hash scheme. Conversions only, kept apart from the engine's
request and KV bookkeeping; vLLM is imported inside them so that this module loads without it.
"""

from __future__ import annotations

from typing import Any

from hetmesh.engines.base import KvEventBatch
from hetmesh.kvindex.blocks import digest_int, next_block
from hetmesh.protocol import TokenLogprob


def token_logprobs(c: Any, ids: list[int], k: int | None) -> list[TokenLogprob] | None:
    """vLLM's per-position {token id: Logprob(logprob, rank)} (the drawn token and the top k) as ours."""
    if k is None or c.logprobs is None:
        return None
    out = []
    for i, tok in enumerate(ids):
        d = c.logprobs[i]
        top = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank is not None and lp.rank <= k)
        drawn = d.get(tok)
        out.append(TokenLogprob(tok, drawn.logprob if drawn is not None else -9999.0, [(t, x) for _, t, x in top]))
    return out


class StepStats:
    """The last SchedulerStats AsyncLLM reported (a StatLoggerBase made by `stat_logger`)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.steps = 0


def stat_logger(sink: StepStats) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class HetmeshStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.sink = sink

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                self.sink.running = scheduler_stats.num_running_reqs
                self.sink.waiting = scheduler_stats.num_waiting_reqs
                self.sink.kv_usage = scheduler_stats.kv_cache_usage
                self.sink.steps += 1

        def log_engine_initialized(self) -> None:
            return

    return HetmeshStatLogger


class KvEventMapper:
    """vLLM block hash -> mesh block digest, fed by vLLM's KV-cache events."""

    def __init__(self, model: str, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.digests: dict[bytes | int, bytes] = {}

    def apply(self, events: list[Any], out: KvEventBatch) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        bs = self.block_size
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.block_size != bs or ev.lora_name or (ev.extra_keys and any(ev.extra_keys)):
                    continue  # not addressable by token ids alone: the gateway could never match it
                parent = None
                if ev.parent_block_hash is not None:
                    parent = self.digests.get(ev.parent_block_hash)
                    if parent is None:
                        continue  # its prefix is unknown to us (e.g. stored before we subscribed)
                for i, h in enumerate(ev.block_hashes):
                    tokens = ev.token_ids[i * bs:(i + 1) * bs]
                    if len(tokens) < bs:
                        break
                    parent = next_block(self.model, parent, tokens)
                    self.digests[h] = parent
                    out.stored.append(digest_int(parent))
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    d = self.digests.pop(h, None)
                    if d is not None:
                        out.removed.append(digest_int(d))
            elif isinstance(ev, AllBlocksCleared):
                self.digests.clear()
                out.stored.clear()
                out.removed.clear()
                out.cleared = True
