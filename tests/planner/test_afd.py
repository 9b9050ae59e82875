"""The attention-FFN disaggregation what-if: its link term, its pipelining, and its pricing."""

from __future__ import annotations

import pytest

from hetmesh.costmodel import server_model
from hetmesh.costmodel.afd import MICRO_BATCHES, afd_step, what_if
from hetmesh.costmodel.economics import device_usd_per_hour
from hetmesh.costmodel.model import link_bandwidth


def test_step_is_the_slowest_side_plus_the_rest_over_the_micro_batches() -> None:
    a = server_model("nvidia-rubin-vr200", "deepseek-r1", devices=8)
    f = server_model("nvidia-rubin-cpx", "deepseek-r1", devices=8)
    s = afd_step(a, f, 64, 4096, latency_s=0.0)
    m = a.model
    assert s.link_s == pytest.approx(2 * m.layers * 64 * m.hidden * 2 / link_bandwidth(a.accel, 8, f.accel, 8))
    parts = (s.attention_s, s.ffn_s, s.link_s)
    assert s.step_s == pytest.approx(max(parts) + (sum(parts) - max(parts)) / MICRO_BATCHES)
    # the attention side reads the KV cache: a longer context slows it, not the FFN side
    longer = afd_step(a, f, 64, 16384, latency_s=0.0)
    assert longer.attention_s > s.attention_s and longer.ffn_s == pytest.approx(s.ffn_s)


def test_what_if_prices_the_pair_and_compares_with_each_server_alone() -> None:
    w = what_if("qwen3-235b-a22b", "amd-mi308x", "amd-mi300x", tpot_slo_s=0.1)
    assert w.usd_per_hour == pytest.approx(8 * (device_usd_per_hour("amd-mi308x") + device_usd_per_hour("amd-mi300x")))
    assert 0 < w.batch <= 2048 and w.tok_per_usd == pytest.approx(w.tok_s * 3600 / w.usd_per_hour)
    assert w.best_single in ("amd-mi308x", "amd-mi300x") and w.pays == pytest.approx(w.tok_per_usd / w.single_tok_per_usd)
