"""Catalog figures against the published ones (configs, datasheets, the seed document)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetmesh.costmodel import CostModel, accelerator, accelerators, model_ids, model_spec

IDS = ["nvidia-a100-80g", "nvidia-h100", "nvidia-h200", "nvidia-b200", "nvidia-rubin-vr200", "nvidia-rubin-cpx",
       "amd-mi300x", "amd-mi308x", "amd-mi325x", "amd-mi355x", "tenstorrent-wormhole-n300",
       "tenstorrent-blackhole-p150", "intel-gaudi3"]


def test_every_accelerator_is_there_with_a_source() -> None:
    cat = accelerators()
    assert sorted(cat) == sorted(IDS)
    for a in cat.values():
        assert a.source and a.memory_bytes > 0 and a.mem_bw > 0 and a.flops
        assert a.scaleup_bw > 0 and a.scaleout_bw > 0


def test_every_price_is_on_the_one_stated_basis_and_says_how_it_was_had() -> None:
    from hetmesh.costmodel.catalog import price_basis

    assert price_basis() == "on-demand cloud rental, $ per device-hour"
    cat = accelerators()
    assert {a.price_confidence for a in cat.values()} == {"listed", "assumed"}
    for a in cat.values():
        assert a.usd_per_hour > 0 and a.price_source, a.id
        if a.price_confidence == "listed":  # public on-demand rates, named
            assert a.price_source.startswith("on-demand:"), a.id
    # the chips with no rental market are priced on the rental basis, not at their amortised purchase
    for acc in ("tenstorrent-blackhole-p150", "tenstorrent-wormhole-n300", "intel-gaudi3"):
        assert cat[acc].price_confidence == "assumed" and "x 3.05" in cat[acc].price_source
    assert cat["tenstorrent-blackhole-p150"].usd_per_hour > 0.5  # a card amortised alone would be ~$0.05


@pytest.mark.parametrize(("acc", "dtype", "pflops", "tb_s"), [
    ("amd-mi300x", "fp8", 2.6, 5.3), ("amd-mi308x", "fp8", 0.47, 5.3),
    ("nvidia-rubin-cpx", "fp4", 20.0, 2.0), ("nvidia-rubin-vr200", "fp4", 33.3, 20.5),
])
def test_seed_figures_are_honoured(acc: str, dtype: str, pflops: float, tb_s: float) -> None:
    a = accelerator(acc)
    assert a.flops[dtype] == pytest.approx(pflops * 1e15, rel=0.01)
    assert a.mem_bw == pytest.approx(tb_s * 1e12)


def test_dtype_falls_back_to_a_wider_native_one() -> None:
    a100 = accelerator("nvidia-a100-80g")
    assert a100.compute_dtype("fp8") == "bf16" and a100.compute_dtype("fp4") == "bf16"
    assert accelerator("nvidia-h100").compute_dtype("fp4") == "fp8"
    assert accelerator("nvidia-b200").compute_dtype("fp4") == "fp4"


def test_unknown_ids_say_what_exists() -> None:
    with pytest.raises(KeyError, match="amd-mi300x"):
        accelerator("amd-mi3000")
    with pytest.raises(KeyError, match="deepseek-r1"):
        model_spec("no-such-model")


def test_parameter_counts_match_the_published_ones() -> None:
    # Llama-3.1-8B: 8,030,261,248 parameters, of which 266,240 are RMSNorm weights we do not count
    assert model_spec("llama-3.1-8b").params == 8_030_261_248 - 266_240
    assert model_spec("llama-3.1-70b").params == pytest.approx(70.6e9, rel=0.005)
    assert model_spec("qwen3-32b").params == pytest.approx(32.8e9, rel=0.01)
    r1 = model_spec("deepseek-r1")
    assert r1.params == pytest.approx(671e9, rel=0.005) and r1.active_params == pytest.approx(37e9, rel=0.03)
    q = model_spec("qwen3-235b-a22b")
    assert q.params == pytest.approx(235e9, rel=0.005) and q.active_params == pytest.approx(22e9, rel=0.03)
    g = model_spec("gpt-oss-120b")
    assert g.params == pytest.approx(116.8e9, rel=0.01) and g.active_params == pytest.approx(5.1e9, rel=0.03)


def test_kv_bytes_per_token() -> None:
    h100 = accelerator("nvidia-h100")
    # GQA: layers * (K and V) * kv_heads * head_dim * 2 bytes
    assert CostModel(h100, model_spec("llama-3.1-8b")).kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2
    # MLA: layers * (kv_lora_rank + rope dim) * 2 bytes, one latent shared by all heads
    assert CostModel(h100, model_spec("deepseek-r1"), devices=8).kv_bytes_per_token() == 61 * (512 + 64) * 2
    tiny = model_spec("tiny-llama")
    assert (tiny.hidden, tiny.layers, tiny.heads, tiny.kv_heads, tiny.head_dim, tiny.vocab, tiny.intermediate,
            tiny.dtype) == (256, 2, 4, 2, 64, 258, 512, "bf16")


def test_reads_a_hf_config_json(tmp_path: Path) -> None:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
           "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    d = tmp_path / "DeepSeek-R1"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    from_file = model_spec(str(d))
    cat = model_spec("deepseek-r1")
    assert from_file.name == "DeepSeek-R1" and from_file.dtype == "fp8"
    assert (from_file.params, from_file.active_params, from_file.kv_elems_per_token()) == (
        cat.params, cat.active_params, cat.kv_elems_per_token())
    assert model_spec(str(d / "config.json"), dtype="bf16").dtype == "bf16"


def test_every_catalog_model_fits_somewhere() -> None:
    for m in model_ids():
        spec = model_spec(m)
        cm = CostModel(accelerator("amd-mi355x"), spec, devices=8)
        assert cm.max_kv_tokens() > 10_000, m
