"""The KV layout across tensor-parallel ranks, as pure functions (no torch, no vLLM): where each rank's
shard lies, which prefill/decode TP pairings the layout allows, and which prefill shards hold a decode
rank's KV heads. Used by the connector (hetmesh.engines.vllm_connector), the worker shell's spool
(hetmesh.engines.vllm_spool) and the start-up check (hetmesh.engines.vllm_args)."""

from __future__ import annotations


def shard_path(path: str, rank: int) -> str:
    """Where TP rank `rank` of a producer writes its shard of the KV named `path`."""
    return f"{path}.rank{rank}"


def tp_pairing_problem(prefill_tp: int, decode_tp: int, num_kv_heads: int) -> str | None:
    """Why a prefill engine of TP `prefill_tp` cannot hand its KV to a decode engine of TP `decode_tp`
    (None: it can). Each rank holds heads [r*H/tp, (r+1)*H/tp) when tp divides H; with tp > H vLLM
    replicates heads across ranks, and only an equal TP keeps every rank's heads where they were."""
    if prefill_tp == decode_tp:
        return None
    for tp in (prefill_tp, decode_tp):
        if num_kv_heads % tp:
            return (f"prefill TP {prefill_tp} -> decode TP {decode_tp}: TP {tp} does not split the model's "
                    f"{num_kv_heads} KV heads into whole slices (vLLM replicates heads across ranks then); "
                    "use equal TP sizes")
    return None


def shard_sources(rank: int, tp: int, src_tp: int, num_kv_heads: int) -> list[tuple[int, int, int]]:
    """For decode rank `rank` of `tp`: (prefill shard, first head in it, heads) covering its KV heads."""
    if tp == src_tp:
        return [(rank, 0, num_kv_heads // tp)]
    lo, hi = rank * num_kv_heads // tp, (rank + 1) * num_kv_heads // tp
    per = num_kv_heads // src_tp
    out = []
    for s in range(src_tp):
        a, b = max(lo, s * per), min(hi, (s + 1) * per)
        if a < b:
            out.append((s, a - s * per, b - a))
    return out
