"""Step-time predictions: hand-computed roofline cases, units, monotonicity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.batching import Step
from hetmesh.costmodel import (
    CostModel,
    Efficiency,
    accelerator,
    link_bandwidth,
    model_spec,
    server_model,
    transfer_time,
)
from hetmesh.costmodel.model import step_seconds_many

IDEAL = Efficiency(compute=1.0, memory=1.0, overhead_s=0.0, per_seq_s=0.0)


def h100_8b(eff: Efficiency = IDEAL) -> CostModel:
    return CostModel(accelerator("nvidia-h100"), model_spec("llama-3.1-8b"), devices=1, efficiency=eff)


def test_decode_is_the_weight_and_kv_read() -> None:
    # batch 1 at 1000 tokens of context: read every non-embedding weight + the LM head once
    # (32 layers x 218,103,808 + 128,256 x 4,096 params, 2 bytes each) and 1000 + 1 tokens of KV.
    nbytes = (32 * 218_103_808 + 128_256 * 4096) * 2 + 1001 * 131_072
    assert h100_8b().decode_step_time(1, 1000) == pytest.approx(nbytes / 3.35e12, rel=1e-9)


def test_prefill_is_compute_bound_with_the_quadratic_attention_term() -> None:
    n = 4096
    linear = 2 * 32 * 218_103_808 * n + 2 * 128_256 * 4096  # every token; logits for the last
    attention = 2 * 32 * (128 + 128) * (n * (n + 1) / 2) * 32  # QK^T and PV per causal pair, per layer
    assert h100_8b().prefill_time(n) == pytest.approx((linear + attention) / 989e12, rel=1e-9)


def test_cached_tokens_are_not_recomputed_but_are_attended_to() -> None:
    cm = h100_8b()
    assert cm.prefill_time(512, cached_tokens=3584) < cm.prefill_time(4096)
    assert cm.prefill_time(512, cached_tokens=3584) > cm.prefill_time(512)


def test_efficiency_and_overheads_scale_the_roofline() -> None:
    base = h100_8b().decode_step_time(1, 1000)
    slow = h100_8b(Efficiency(compute=1.0, memory=0.5, overhead_s=0.003, per_seq_s=0.001))
    assert slow.decode_step_time(1, 1000) == pytest.approx(2 * base + 0.003 + 0.001)


def test_tensor_parallel_splits_the_work_and_pays_for_all_reduces() -> None:
    one = h100_8b()
    eight = CostModel(accelerator("nvidia-h100"), model_spec("llama-3.1-8b"), devices=8, efficiency=IDEAL)
    t1, t8 = one.prefill_time(4096), eight.prefill_time(4096)
    comm = 4096 * 2 * 32 * (2 * 7 / 8) * (2 * 4096) / 450e9  # two ring all-reduces of bf16 activations a layer
    assert t8 == pytest.approx(t1 / 8 + comm, rel=1e-6)
    assert eight.max_kv_tokens() > 8 * one.max_kv_tokens()  # weights stored once, spread over 8


def test_moe_decode_reads_only_the_experts_it_touches() -> None:
    cm = CostModel(accelerator("amd-mi300x"), model_spec("deepseek-r1"), devices=8, efficiency=IDEAL)
    full_read = cm.weights_bytes() / (8 * 5.3e12)
    assert cm.decode_step_time(1, 1) < 0.1 * full_read  # 8 of 256 experts per layer at batch 1
    assert cm.decode_step_time(256, 256) > 0.8 * full_read  # nearly all experts at batch 256


def test_units_of_a_kv_transfer() -> None:
    assert transfer_time(10**9, 100e9, latency_s=0.0) == pytest.approx(0.01)
    assert transfer_time(10**9, 100e9, latency_s=1e-3) == pytest.approx(0.011)
    assert transfer_time(0, 1e9) == 0.0
    mi300x, mi308x = accelerator("amd-mi300x"), accelerator("amd-mi308x")
    assert link_bandwidth(mi300x, 8, mi308x, 8) == pytest.approx(8 * 50e9)
    cm = CostModel(mi300x, model_spec("deepseek-r1"), devices=8)
    assert cm.kv_transfer_time(1000, 400e9, latency_s=0.0) == pytest.approx(1000 * 70_272 / 400e9)
    with pytest.raises(ValueError):
        transfer_time(1, 0.0)


def test_capacity_after_weights() -> None:
    cm = CostModel(accelerator("amd-mi300x"), model_spec("deepseek-r1"), devices=8, efficiency=IDEAL)
    free = 8 * 192e9 * 0.9 - cm.weights_bytes()
    assert cm.max_kv_tokens() == int(free // 70_272)
    assert cm.max_batch(4096) == cm.max_kv_tokens() // 4096
    # 671 GB of FP8 weights do not fit on one 80 GB H100
    assert CostModel(accelerator("nvidia-h100"), model_spec("deepseek-r1")).max_kv_tokens() == 0


def test_an_empty_step_takes_no_time() -> None:
    cm = h100_8b(Efficiency())
    assert cm.step_time([], []) == 0.0 and cm.decode_step_time(0, 0) == 0.0


MODELS = st.sampled_from(["llama-3.1-8b", "deepseek-r1", "gpt-oss-120b", "qwen3-235b-a22b"])
ACCS = st.sampled_from(["nvidia-h100", "amd-mi300x", "nvidia-rubin-cpx", "tenstorrent-wormhole-n300"])


def _cm(acc: str, model: str) -> CostModel:
    return CostModel(accelerator(acc), model_spec(model), devices=8, efficiency=Efficiency())


@settings(max_examples=60, deadline=None)
@given(ACCS, MODELS, st.integers(1, 20_000), st.integers(1, 5_000), st.integers(0, 20_000))
def test_prefill_grows_with_new_and_cached_tokens(acc: str, model: str, n: int, dn: int, c: int) -> None:
    cm = _cm(acc, model)
    assert cm.prefill_time(n + dn, c) >= cm.prefill_time(n, c)
    assert cm.prefill_time(n, c + dn) >= cm.prefill_time(n, c)


@settings(max_examples=60, deadline=None)
@given(ACCS, MODELS, st.integers(1, 256), st.integers(1, 64), st.integers(1, 8192), st.integers(0, 8192))
def test_decode_grows_with_batch_and_context(acc: str, model: str, b: int, db: int, ctx: int, dc: int) -> None:
    cm = _cm(acc, model)
    t = cm.decode_step_time(b, b * ctx)
    assert cm.decode_step_time(b + db, (b + db) * ctx) >= t
    assert cm.decode_step_time(b, b * ctx + dc) >= t
    # batching amortises the weight read: tokens/s never drops when the batch grows
    assert cm.decode_throughput(b + db, ctx) >= cm.decode_throughput(b, ctx) * (1 - 1e-9)


@settings(max_examples=60, deadline=None)
@given(ACCS, MODELS, st.integers(1, 8192), st.lists(st.integers(1, 8192), min_size=1, max_size=32))
def test_a_mixed_step_costs_less_than_separate_ones(acc: str, model: str, n: int, ctxs: list[int]) -> None:
    cm = _cm(acc, model)
    mixed = cm.step_time([(n, 0)], ctxs)
    apart = cm.prefill_time(n) + cm.step_time([], ctxs)
    assert max(cm.prefill_time(n), cm.step_time([], ctxs)) <= mixed <= apart * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(ACCS, MODELS, st.integers(1, 100_000), st.integers(1, 100_000))
def test_max_batch_shrinks_with_context(acc: str, model: str, c: int, dc: int) -> None:
    cm = _cm(acc, model)
    assert cm.max_batch(c + dc) <= cm.max_batch(c)


_SERVERS = [("amd-mi300x", "deepseek-r1", 8, "tp"), ("amd-mi300x", "deepseek-r1", 8, "ep"),
            ("nvidia-h100", "llama-3.1-70b", 8, "tp"), ("nvidia-h100", "llama-3.1-70b", 8, "dp"),
            ("nvidia-rubin-cpx", "llama-3.1-70b", 1, "tp")]


@settings(max_examples=200, deadline=None)
@given(server=st.sampled_from(_SERVERS), new=st.integers(0, 16384), cached=st.integers(0, 32768),
       batch=st.integers(0, 256), ctx=st.integers(1, 16384))
def test_the_step_time_api_and_its_array_form_are_the_step_time_model(server: tuple[str, str, int, str], new: int,
                                                                      cached: int, batch: int, ctx: int) -> None:
    """CostModel.step_seconds (engines, simulator) and step_seconds_many (the cost policy) are the model's
    step_time_totals, folded: equal within rounding for any step shape."""
    acc, spec, devices, parallel = server
    cm = server_model(acc, spec, devices=devices, parallel=parallel)
    step = Step(0)
    step.prefill_tokens, step.prefill_seqs = new, 1 if new else 0
    step.prefill_pairs, step.prefill_cached = new * cached + new * (new + 1) // 2, cached if new else 0
    step.n_decode, step.decode_context = batch, batch * ctx
    shape = (step.prefill_tokens, step.prefill_seqs, step.prefill_pairs, step.prefill_cached, batch, batch * ctx)
    want = cm.step_time_totals(*shape)
    assert cm.step_seconds(step) == pytest.approx(want, rel=1e-12, abs=1e-15)
    many = step_seconds_many(np.array([cm.coefficients()] * 2).T, *(np.array([v, v], dtype=float) for v in shape))
    assert many.tolist() == pytest.approx([want, want], rel=1e-12, abs=1e-15)
