"""The step-time model: how long one engine step takes on a server for a given batch shape.

A continuous-batching step runs every scheduled token (prefill chunks and one token per decoding sequence)
through the model once; its time is a roofline per kind of kernel (dense GEMMs, expert GEMMs, attention),
summed, plus overhead, a per-sequence cost and the parallel layout's communication. Efficiency factors come
from calibration (hetmesh.costmodel.calibrate). The formula and what each term counts: docs/costmodel.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from hetmesh.costmodel.catalog import DTYPE_BYTES, Accelerator, ModelSpec, norm_dtype
from hetmesh.costmodel.efficiency import Efficiency, default_efficiency

PARALLEL = ("tp", "ep", "dp")
DEFAULT_LINK_LATENCY_S = 50e-6  # one RDMA round trip plus setup


class StepShape(Protocol):
    """The totals of one engine step (hetmesh.batching.Step has them)."""

    prefill_tokens: int
    prefill_seqs: int
    prefill_pairs: int
    prefill_cached: int
    n_decode: int
    decode_context: int


def transfer_time(nbytes: int, link_bytes_per_s: float, latency_s: float = DEFAULT_LINK_LATENCY_S) -> float:
    """Seconds to move `nbytes` over a link of `link_bytes_per_s` (0 bytes still pays no latency)."""
    if nbytes < 0 or link_bytes_per_s <= 0:
        raise ValueError("nbytes must be >= 0 and the link bandwidth > 0")
    return 0.0 if nbytes == 0 else latency_s + nbytes / link_bytes_per_s


def link_bandwidth(src: Accelerator, src_devices: int, dst: Accelerator, dst_devices: int) -> float:
    """KV transfer bandwidth between two servers: every device's NIC in parallel, the slower side limits."""
    return min(src.scaleout_bw * src_devices, dst.scaleout_bw * dst_devices)


def _pairs_prefill(new: int, cached: int, window: int) -> float:
    """Attention (query, key) pairs for `new` tokens after `cached` ones, causal, optional window."""
    full = new * cached + new * (new + 1) / 2
    if window <= 0:
        return full
    return min(full, new * float(window))


class CostModel:
    """Step times of one engine (a server of `devices` accelerators) serving one model."""

    def __init__(
        self,
        accel: Accelerator,
        model: ModelSpec,
        devices: int = 1,
        parallel: str = "tp",
        dtype: str | None = None,
        efficiency: Efficiency | None = None,
        kv_dtype: str = "bf16",
        memory_utilization: float = 0.9,
    ) -> None:
        if devices < 1:
            raise ValueError("devices must be >= 1")
        if parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}")
        if (parallel == "ep" and not model.is_moe) or devices == 1:
            parallel = "tp"  # no experts to spread, or one device to spread over: the layouts are one engine
        self.accel = accel
        self.model = model
        self.devices = devices
        self.parallel = parallel
        self.dtype = norm_dtype(dtype or model.dtype)
        self.kv_dtype = norm_dtype(kv_dtype)
        self.eff = efficiency or default_efficiency(accel.id, model.name)
        self.memory_utilization = memory_utilization
        self._folded: tuple[float, ...] | None = None

        m = model
        wb = DTYPE_BYTES[self.dtype]
        # dp: every device is its own engine holding all weights; a step's work splits evenly
        self._replicas = devices if parallel == "dp" else 1
        engine_devices = 1 if parallel == "dp" else devices
        self._peak = accel.peak_flops(self.dtype) * engine_devices
        self._bw = accel.mem_bw * engine_devices
        self._weights_bytes = m.params * wb
        self._fixed_bytes = (m.shared_params + m.vocab * m.hidden) * wb  # read every step (+ LM head)
        self._expert_bytes = m.expert_params * wb
        self._moe_layers = m.moe_layers
        self._k_frac = m.experts_per_token / m.experts if m.is_moe else 0.0
        self._dense_flops_per_token = 2.0 * m.shared_params
        self._expert_flops_per_token = 2.0 * m.moe_layers * m.experts_per_token * m.expert_params
        self._attn_peak = accel.peak_flops("bf16") * engine_devices  # attention math stays in bf16
        self._flops_per_logit = 2.0 * m.vocab * m.hidden
        self._kvpt = int(m.kv_elems_per_token() * DTYPE_BYTES[self.kv_dtype])
        full_layers = m.layers - m.sliding_layers
        qk, v = m.attn_dims(decode=False)
        self._attn_pf = 2.0 * m.heads * (qk + v)  # FLOPs per (query, key) pair per layer, prefill
        qk, v = m.attn_dims(decode=True)
        self._attn_dec = 2.0 * m.heads * (qk + v)
        self._full_layers = full_layers
        self._window = m.sliding_window
        self._sliding_layers = m.sliding_layers
        # comm bytes per token per device per step, over scale-up links
        act = 2 * m.hidden  # bf16 activations
        n = engine_devices
        ring = 2 * (n - 1) / n if n > 1 else 0.0
        su = accel.scaleup_bw
        if parallel == "tp":
            self._comm_per_token = 2 * m.layers * ring * act / su  # two all-reduces per layer
        elif parallel == "ep":
            a2a = 2 * m.experts_per_token * act * (n - 1) / n / n  # dispatch + combine, tokens spread over n
            self._comm_per_token = (m.layers * ring * act + m.moe_layers * a2a) / su
        else:
            self._comm_per_token = 0.0

    # ---- capacity ----
    def kv_bytes_per_token(self) -> int:
        return self._kvpt

    def weights_bytes(self) -> float:
        return self._weights_bytes

    def max_kv_tokens(self) -> int:
        """KV cache capacity in tokens: usable memory of all devices minus the weights they hold."""
        per_dev = self.accel.memory_bytes * self.memory_utilization
        if self.parallel == "dp":
            free = self.devices * (per_dev - self._weights_bytes) if per_dev > self._weights_bytes else 0.0
        else:
            free = self.devices * per_dev - self._weights_bytes
        return max(int(free // self._kvpt), 0)

    def max_batch(self, context: int) -> int:
        """Sequences of `context` tokens whose KV fits at once."""
        return self.max_kv_tokens() // max(context, 1)

    # ---- time ----
    def features(
        self, tokens: float, logits: float, pf_pairs: float, dec_pairs: float, kv_read: float, seqs: float,
        pf_pairs_window: float = 0.0, dec_pairs_window: float = 0.0,
    ) -> tuple[float, ...]:
        """Per-op (compute s, memory s) at 100% efficiency, then comm s and sequences, of one step.

        Returns (dense_c, dense_m, expert_c, expert_m, attn_c, attn_m, comm, seqs). pf_pairs /
        dec_pairs: attention pairs per full-attention layer; *_window: per sliding layer.
        """
        r = self._replicas
        t = tokens / r
        dense_c = (self._dense_flops_per_token * t + self._flops_per_logit * logits / r) / self._peak
        dense_m = self._fixed_bytes / self._bw
        if self._moe_layers:
            touched = self.model.experts * (1.0 - (1.0 - self._k_frac) ** t)
            exp_c = self._expert_flops_per_token * t / self._peak
            exp_m = self._moe_layers * touched * self._expert_bytes / self._bw
        else:
            exp_c = exp_m = 0.0
        attn_flops = (self._attn_pf * (pf_pairs * self._full_layers + pf_pairs_window * self._sliding_layers)
                      + self._attn_dec * (dec_pairs * self._full_layers + dec_pairs_window * self._sliding_layers))
        attn_c = attn_flops / r / self._attn_peak
        attn_m = (kv_read / r + t) * self._kvpt / self._bw
        return dense_c, dense_m, exp_c, exp_m, attn_c, attn_m, self._comm_per_token * t, seqs / r

    def _time(self, f: tuple[float, ...]) -> float:
        e = self.eff
        ic, im = 1.0 / e.compute, 1.0 / e.memory
        return (e.overhead_s + e.per_seq_s * f[7] + f[6] + max(f[0] * ic, f[1] * im) + max(f[2] * ic, f[3] * im)
                + max(f[4] * ic, f[5] * im))

    def step_features(
        self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
    ) -> tuple[float, ...]:
        w = self._window
        pf_pairs = pf_win = 0.0
        kv_read = 0.0
        new_tokens = 0
        for new, cached in prefills:
            if new < 0 or cached < 0:
                raise ValueError("token counts must be >= 0")
            new_tokens += new
            pf_pairs += _pairs_prefill(new, cached, 0)
            if w:
                pf_win += _pairs_prefill(new, cached, w)
            kv_read += cached
        n_dec = len(decode_contexts)
        dec_pairs = float(sum(decode_contexts))
        dec_win = float(sum(min(c, w) for c in decode_contexts)) if w else 0.0
        kv_read += dec_pairs
        n_pf = sum(1 for new, _ in prefills if new > 0)
        return self.features(new_tokens + n_dec, n_pf + n_dec, pf_pairs, dec_pairs, kv_read, n_pf + n_dec,
                             pf_win, dec_win)

    def step_time(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds for one step running prefill chunks (new, cached) and decode sequences (context each)."""
        if not decode_contexts and not any(new for new, _ in prefills):
            return 0.0
        return self._time(self.step_features(prefills, decode_contexts))

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill `new_tokens` after `cached_tokens` already in the KV cache, alone in a step."""
        return self.step_time([(new_tokens, cached_tokens)], [])

    def decode_step_time(self, batch: int, total_context: int) -> float:
        """Seconds for one decode step of `batch` sequences holding `total_context` tokens in all."""
        if batch <= 0:
            return 0.0
        if total_context < batch:
            raise ValueError("each decoding sequence has at least one token of context")
        w = self._window
        win = min(total_context, batch * w) if w else 0.0
        return self._time(self.features(batch, batch, 0.0, total_context, total_context, batch, 0.0, win))

    def step_time_totals(self, prefill_new: int, prefill_seqs: int, prefill_pairs: float, prefill_cached: int,
                         decode_batch: int, decode_context: int) -> float:
        """Fast path for simulators that keep running sums (full-attention models; windows ignored)."""
        tokens = prefill_new + decode_batch
        if tokens == 0:
            return 0.0
        seqs = prefill_seqs + decode_batch
        return self._time(self.features(tokens, seqs, prefill_pairs, decode_context,
                                        prefill_cached + decode_context, seqs))

    def step_seconds(self, step: StepShape) -> float:
        """Seconds for one batching-core step (hetmesh.batching.Step): the one step-time API of the engines,
        the simulator and (over arrays, `step_seconds_many`) the cost policy. `step_time_totals`, folded."""
        c = self._folded
        if c is None:
            c = self._folded = self.coefficients()
        inv_r, dense_c, dense_cs, dense_m, exp_c, log_miss, exp_m, attn_pf, attn_dec, attn_m, comm, overhead, per_seq = c
        dec_ctx = step.decode_context
        tokens = step.prefill_tokens + step.n_decode
        if not tokens:
            return 0.0
        seqs = step.prefill_seqs + step.n_decode
        t = tokens * inv_r
        dense = dense_c * t + dense_cs * seqs
        expert = exp_c * t
        if exp_m:
            expert = max(expert, (1.0 - math.exp(log_miss * t)) * exp_m)
        attn = attn_pf * step.prefill_pairs + attn_dec * dec_ctx
        attn_mem = ((step.prefill_cached + dec_ctx) * inv_r + t) * attn_m
        return (overhead + per_seq * seqs + comm * t + (dense if dense > dense_m else dense_m) + expert
                + (attn if attn > attn_mem else attn_mem))

    def coefficients(self) -> tuple[float, ...]:
        """`step_time_totals` folded into per-server constants: one column of `step_seconds_many`'s table
        (the order is COEFFICIENTS)."""
        e = self.eff
        ic, im, r = 1.0 / e.compute, 1.0 / e.memory, float(self._replicas)
        experts = float(self.model.experts if self._moe_layers else 0)
        return (1.0 / r, self._dense_flops_per_token / self._peak * ic, self._flops_per_logit / (r * self._peak) * ic,
                self._fixed_bytes / self._bw * im, self._expert_flops_per_token / self._peak * ic,
                math.log1p(-self._k_frac) if experts else 0.0,
                self._moe_layers * experts * self._expert_bytes / self._bw * im,
                self._attn_pf * self._full_layers / (r * self._attn_peak) * ic,
                self._attn_dec * self._full_layers / (r * self._attn_peak) * ic,
                self._kvpt / self._bw * im, self._comm_per_token, e.overhead_s, e.per_seq_s / r)

    def decode_throughput(self, batch: int, context: int) -> float:
        """Output tokens/s of a steady decode batch of `batch` sequences at `context` tokens each."""
        return batch / self.decode_step_time(batch, batch * context)

    def kv_transfer_time(self, tokens: int, link_bytes_per_s: float,
                         latency_s: float = DEFAULT_LINK_LATENCY_S) -> float:
        return transfer_time(tokens * self._kvpt, link_bytes_per_s, latency_s)


COEFFICIENTS = ("inv_replicas", "dense_c", "dense_c_seq", "dense_m", "expert_c", "log_miss", "expert_m", "attn_c_pf",
                "attn_c_dec", "attn_m", "comm", "overhead_s", "per_seq_s")


def step_seconds_many(c: np.ndarray, prefill_new: np.ndarray, prefill_seqs: np.ndarray, prefill_pairs: np.ndarray,
                      prefill_cached: np.ndarray, decode_batch: np.ndarray, decode_context: np.ndarray,
                      experts: bool = True) -> np.ndarray:
    """`CostModel.step_time_totals` for many (server, step) pairs at once: column i of `c` (shape
    (len(COEFFICIENTS), n)) is server i's `coefficients()`. The same model, folded (equal to the scalar
    path within rounding), so a policy pricing hundreds of workers per request stays cheap. experts=False: no
    server in `c` has experts (`has_experts`), and their term, 0 for each, is left out (the same floats)."""
    inv_r, dense_c, dense_cs, dense_m, exp_c, log_miss, exp_m, attn_pf, attn_dec, attn_m, comm, overhead, per_seq = c
    tokens = prefill_new + decode_batch
    seqs = prefill_seqs + decode_batch
    t = tokens * inv_r
    out = overhead + per_seq * seqs + comm * t + np.maximum(dense_c * t + dense_cs * seqs, dense_m)
    if experts:  # experts touched: E * (1 - (1 - k/E)^t), as a fraction folded into exp_m
        out += np.maximum(exp_c * t, (1.0 - np.exp(log_miss * t)) * exp_m)
    out += np.maximum(attn_pf * prefill_pairs + attn_dec * decode_context,
                      ((prefill_cached + decode_context) * inv_r + t) * attn_m)
    return np.where(tokens == 0, 0.0, out)


def has_experts(c: np.ndarray) -> bool:
    """Whether any server of `c` (step_seconds_many's table) has experts: their term is 0 for the others."""
    return bool(c[4].any() or c[6].any())  # expert_c, expert_m
