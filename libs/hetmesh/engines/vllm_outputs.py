"""What vLLM reports, in the mesh's terms, for the `vllm` engine (hetmesh.engines.vllm_engine): a
token's logprobs, the scheduler stats vLLM's stat logger hands over each iteration, and its KV-cache
events mapped onto the mesh's one block-hash scheme. Conversions only, kept apart from the engine's
request and KV bookkeeping; vLLM is imported inside them so that this module loads without it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from hetmesh.costmodel.learn import StepLog
from hetmesh.engines.base import KvEventBatch
from hetmesh.kvindex.blocks import digest_int, next_block
from hetmesh.protocol import StepSample, TokenLogprob


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
    """The last SchedulerStats AsyncLLM reported (a StatLoggerBase made by `stat_logger`), and each engine step as
    a StepSample (vLLM's per-iteration details, enable_logging_iteration_details) in a bounded log."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.steps = 0
        self.log = StepLog()
        self.requests: Any = None  # the output processor's request states (set once the engine is up)
        self.contexts: dict[str, int] = {}  # request -> its context at the next step, as of the last step
        self.gap_s = 0.0  # a step's time beyond the model's (scheduling, output processing), from decode steps
        # Unsampled totals over all steps: prefill tokens computed, decode tokens, wall seconds.
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.seconds = 0.0


def step_sample(details: Any, states: Any, last: dict[str, int], itl: Sequence[float] = (),
                sink: StepStats | None = None) -> StepSample | None:
    """One engine step as a StepSample. vLLM's iteration details give the step's prefill tokens and sequences,
    its decode sequences and the model's wall time (execute + sample), exactly; the context each sequence held is
    not in them, so it comes from the output processor's request states, read right after this step's outputs
    were applied: a request with g >= 2 tokens decoded at context prompt + g - 1; one with g == 1 finished its
    prefill here (its cached prefix is known). A request that finished in this step is already gone: its context
    is the one `last` (updated here) held for it. Should the count still differ from vLLM's, the decode context
    is the mean of the ones seen times vLLM's decode count; prefill chunks not ending here are taken as equal
    chunks of the step's prefill tokens after no cached tokens.

    The step's seconds: the model's time (vLLM's elapsed) leaves out the engine loop's own work around it
    (scheduling, output processing), which every token waits for too. A decode sequence's inter-token latency
    (`itl`, engine-core clock) is the whole step, so a step with decodes takes their median; a step without
    takes the model's time plus the gap (whole - model) last seen on decode steps (kept in `sink`)."""
    if details is None or details.is_dummy or details.elapsed_ms <= 0:
        return None
    n_dec, n_pf, pf_tokens = details.num_generation_requests, details.num_ctx_requests, details.num_ctx_tokens
    if n_dec + pf_tokens <= 0:
        return None
    ctx: list[int] = []
    done: list[tuple[int, int]] = []  # (new, cached) of prefills that ended in this step
    now: dict[str, int] = {}
    for rid, st in list((states or {}).items()):
        g = st.stats.num_generation_tokens if st.stats is not None else 0
        if g >= 1:
            now[rid] = st.prompt_len + g
        if g >= 2:
            ctx.append(st.prompt_len + g - 1)
        elif g == 1:
            cached = min(st.num_cached_tokens or 0, st.prompt_len)
            done.append((st.prompt_len - cached, cached))
    ctx += [c for rid, c in last.items() if rid not in now]  # finished in this step (or aborted: a guess)
    last.clear()
    last.update(now)
    decode_context = round(sum(ctx) / len(ctx) * n_dec) if ctx else n_dec  # >= 1 token per sequence
    if done and len(done) == n_pf and sum(n for n, _ in done) == pf_tokens:
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in done)
        cached = sum(c for _, c in done)
    else:
        c = pf_tokens / max(n_pf, 1)
        pairs, cached = n_pf * c * (c + 1) / 2, 0
    model_s = details.elapsed_ms / 1e3
    seconds = model_s + (sink.gap_s if sink is not None else 0.0)
    if n_dec and itl:
        whole = statistics.median(itl)
        if whole >= model_s:
            seconds = whole
            if sink is not None:
                sink.gap_s += 0.1 * (whole - model_s - sink.gap_s)
    return StepSample(pf_tokens, n_pf, float(pairs), cached, n_dec, max(decode_context, n_dec), seconds)


def stat_logger(sink: StepStats) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class HetmeshStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.sink = sink

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            s = self.sink
            s.running = scheduler_stats.num_running_reqs
            s.waiting = scheduler_stats.num_waiting_reqs
            s.kv_usage = scheduler_stats.kv_cache_usage
            s.steps += 1
            sample = step_sample(getattr(scheduler_stats, "iteration_details", None), s.requests, s.contexts,
                                 iteration_stats.inter_token_latencies_iter if iteration_stats is not None else (),
                                 s)
            if sample is not None:
                s.log.add(sample)
                s.prefill_tokens += sample.prefill_tokens
                s.decode_tokens += sample.n_decode
                s.seconds += sample.seconds

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
