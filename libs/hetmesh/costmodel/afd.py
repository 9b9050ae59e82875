"""Attention-FFN disaggregation, what-if only (MegaScale-Infer, Step-3 AFD): a MoE model's decode with
attention (and the KV cache) on one server and the FFN / experts on another, activations crossing
the link between them twice per layer, two micro-batches in ping-pong so each side works while the
other does. Priced with the same roofline terms as CostModel (its `features`): the attention op and
the attention projections on the attention server, the experts and the dense MLPs on the FFN
server, each at its own efficiency factors. The planner reports whether a pair would pay; the mesh
does not serve this way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hetmesh.costmodel.calibrate import server_model
from hetmesh.costmodel.economics import device_usd_per_hour
from hetmesh.costmodel.model import DEFAULT_LINK_LATENCY_S, CostModel, link_bandwidth

MICRO_BATCHES = 2  # ping-pong: while one micro-batch is in attention, the other is in the FFN


@dataclass(frozen=True)
class AfdStep:
    attention_s: float
    ffn_s: float
    link_s: float
    step_s: float  # pipelined over MICRO_BATCHES


def _attention_share(cm: CostModel) -> float:
    """The attention projections' share of the weights every token reads (the rest: dense MLPs,
    shared experts, routers, LM head)."""
    m = cm.model
    return m.layers * m.attn_params_per_layer / (m.shared_params + m.vocab * m.hidden)


def afd_step(attn: CostModel, ffn: CostModel, batch: int, context: int,
             latency_s: float = DEFAULT_LINK_LATENCY_S) -> AfdStep:
    """One decode step of `batch` sequences at `context` tokens each, attention on `attn`'s server and
    the FFN on `ffn`'s (both CostModels of the same model)."""
    share = _attention_share(attn)
    fa = attn.features(batch, batch, 0.0, batch * context, batch * context, batch)
    ff = ffn.features(batch, batch, 0.0, 0.0, 0.0, batch)
    ea, ef = attn.eff, ffn.eff
    t_attn = (ea.overhead_s + ea.per_seq_s * batch + fa[6]
              + max(fa[0] * share / ea.compute, fa[1] * share / ea.memory)
              + max(fa[4] / ea.compute, fa[5] / ea.memory))
    t_ffn = (ef.overhead_s + max(ff[0] * (1 - share) / ef.compute, ff[1] * (1 - share) / ef.memory)
             + max(ff[2] / ef.compute, ff[3] / ef.memory))
    m = attn.model
    act_bytes = 2 * m.layers * batch * m.hidden * 2  # there and back per layer, bf16
    bw = link_bandwidth(attn.accel, attn.devices, ffn.accel, ffn.devices)
    t_link = act_bytes / bw + 2 * m.layers * latency_s
    top = max(t_attn, t_ffn, t_link)
    return AfdStep(t_attn, t_ffn, t_link, top + (t_attn + t_ffn + t_link - top) / MICRO_BATCHES)


@dataclass(frozen=True)
class AfdWhatIf:
    attention: str
    ffn: str
    batch: int
    tok_s: float
    usd_per_hour: float
    tok_per_usd: float  # output tokens per dollar
    best_single: str  # the cheapest-per-token single server of either kind serving alone ("" if neither fits)
    single_tok_per_usd: float

    @property
    def pays(self) -> float:
        """Tokens per dollar of the pair over the best single server (> 1: the split pays)."""
        return self.tok_per_usd / self.single_tok_per_usd if self.single_tok_per_usd else float("inf")


def _best_batch(step: Callable[[int], float], max_batch: int, tpot_slo_s: float) -> tuple[int, float]:
    """The largest batch whose step stays within the TPOT SLO (steps grow with the batch), and its step."""
    if max_batch < 1 or step(1) > tpot_slo_s:
        return 0, 0.0
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step(mid) <= tpot_slo_s else (lo, mid - 1)
    return lo, step(lo)


def what_if(spec: str, attention: str, ffn: str, devices: int = 8, context: int = 4096, tpot_slo_s: float = 0.1,
            max_batch: int = 2048, prices: dict[str, float] | None = None) -> AfdWhatIf:
    """Decode tokens per dollar of `spec` with attention on a server of `attention` and the FFN on one of
    `ffn`, at the largest batch within the TPOT SLO whose KV fits the attention server (after the
    attention weights), against either server serving the model alone."""
    a = server_model(attention, spec, devices=devices)
    f = server_model(ffn, spec, devices=devices)
    share = _attention_share(a)
    weights = a.weights_bytes()
    attn_free = a.accel.memory_bytes * a.memory_utilization * devices - weights * share
    kv_cap = int(attn_free // max(a.kv_bytes_per_token() * context, 1))
    b, t = _best_batch(lambda n: afd_step(a, f, n, context).step_s, min(max_batch, max(kv_cap, 0)), tpot_slo_s)
    usd = (device_usd_per_hour(attention, prices) + device_usd_per_hour(ffn, prices)) * devices
    pair = b / t * 3600 / usd if b else 0.0
    single, single_name = 0.0, ""
    for name, cm in ((attention, a), (ffn, f)):
        cap = min(max_batch, cm.max_batch(context))
        bs, ts = _best_batch(lambda n, cm=cm: cm.decode_step_time(n, n * context), cap, tpot_slo_s)
        v = bs / ts * 3600 / (device_usd_per_hour(name, prices) * devices) if bs else 0.0
        if v > single:
            single, single_name = v, name
    return AfdWhatIf(attention, ffn, b, b / t if b else 0.0, usd, pair, single_name, single)
