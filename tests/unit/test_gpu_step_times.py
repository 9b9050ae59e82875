"""The GPU step-time benchmark's model (benchmarks/gpu_step_times.py) on the CPU, tiny: its three step kinds
compute the same thing, so that their times compare like with like."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed (it comes with vLLM's CPU build: HETMESH_VLLM=1 "
                                        "ops/setup.sh)")]


def test_a_mixed_step_gives_the_prefills_and_the_decodes_tokens() -> None:
    import gpu_step_times as g
    import torch

    s = g.TINY
    torch.manual_seed(0)
    with torch.inference_mode():
        w = g.build_weights(s, torch.device("cpu"), torch.float32)
        chunk = torch.randint(0, s.vocab, (1, 64))
        ids = torch.randint(0, s.vocab, (4,))
        caches = [(torch.randn(4, s.kv_heads, s.context, s.head_dim), torch.randn(4, s.kv_heads, s.context, s.head_dim))
                  for _ in range(s.layers)]
        both = g.mixed_step(w, s, chunk, ids, caches)
        assert both[:1].tolist() == g.prefill(w, s, chunk).tolist()
        assert both[1:].tolist() == g.decode_step(w, s, ids, caches).tolist()


def test_a_decode_step_continues_its_prefill() -> None:
    """The prompt's last token decoded against the cache its first T-1 tokens would leave (built by the same
    layers) predicts what the prefill of all T predicts."""
    import gpu_step_times as g
    import torch
    import torch.nn.functional as F

    s = g.TINY
    torch.manual_seed(1)
    with torch.inference_mode():
        w = g.build_weights(s, torch.device("cpu"), torch.float32)
        ids = torch.randint(0, s.vocab, (1, s.context))
        want = g.prefill(w, s, ids)
        # the cache of the first context-1 tokens, layer by layer, as the prefill computes them
        hd, x, caches = s.head_dim, w["embed"][ids[0, :-1]], []
        cos, sin = w["cos"][: s.context - 1], w["sin"][: s.context - 1]
        for lw in w["layers"]:
            h = F.rms_norm(x, (s.hidden,), lw["ln1"], 1e-5)
            q, k, v = (h @ lw["qkv"].T).split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], dim=-1)
            kc = torch.zeros(1, s.kv_heads, s.context, hd)
            vc = torch.zeros(1, s.kv_heads, s.context, hd)
            kc[0, :, :-1] = g.rope(k.view(-1, s.kv_heads, hd).transpose(0, 1), cos, sin)
            vc[0, :, :-1] = v.view(-1, s.kv_heads, hd).transpose(0, 1)
            caches.append((kc, vc))
            t = x.shape[0]
            qh = g.rope(q.view(t, s.heads, hd).transpose(0, 1), cos, sin)
            g_ = s.heads // s.kv_heads
            a = F.scaled_dot_product_attention(qh[None], kc[0, :, :-1].repeat_interleave(g_, 0)[None],
                                               vc[0, :, :-1].repeat_interleave(g_, 0)[None], is_causal=True)[0]
            x = x + a.transpose(0, 1).reshape(t, -1) @ lw["o"].T
            x = x + g.mlp(F.rms_norm(x, (s.hidden,), lw["ln2"], 1e-5), lw)
        got = g.decode_step(w, s, ids[0, -1:], caches)
        assert got.tolist() == want.tolist()
