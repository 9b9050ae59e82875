"""Accelerator and model catalogs: the data files shipped next to this module, read once.

`accelerator(id)` and `model_spec(spec)` are the lookups everything else uses. A model spec is
a catalog id or a path to a Hugging Face config.json; both go through `ModelSpec.from_config`,
so the catalog entries use the config.json key names.
"""

from __future__ import annotations

import csv
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5}
_WIDER = {"fp4": "fp8", "fp8": "bf16", "fp16": "bf16", "bf16": "bf16", "fp32": "bf16"}
_ALIASES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8": "fp8", "mxfp4": "fp4",
            "nvfp4": "fp4", "float8_e4m3fn": "fp8", "int8": "fp8", "int4": "fp4"}


def norm_dtype(dtype: str) -> str:
    d = dtype.lower()
    d = _ALIASES.get(d, d)
    if d not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPE_BYTES)}")
    return d


@dataclass(frozen=True)
class Accelerator:
    id: str
    name: str
    vendor: str
    flops: Mapping[str, float]  # dense FLOP/s per device, by dtype natively supported
    memory_bytes: float
    memory_type: str
    mem_bw: float  # bytes/s per device
    scaleup_bw: float  # bytes/s per device, one way, inside a server
    scaleout_bw: float  # bytes/s per device, one way, between servers
    confidence: str = ""
    source: str = ""
    usd_per_hour: float = 0.0  # $ per device-hour, on the catalog's one price basis (`price_basis`)
    price_confidence: str = ""  # listed (public rates) | assumed (our estimate): price_source says which
    price_source: str = ""

    def compute_dtype(self, dtype: str) -> str:
        """The dtype the math runs in: `dtype` if supported, else the next wider one (fp4 -> fp8 -> bf16)."""
        d = norm_dtype(dtype)
        while d not in self.flops and _WIDER[d] != d:
            d = _WIDER[d]
        return d

    def peak_flops(self, dtype: str) -> float:
        return self.flops[self.compute_dtype(dtype)]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dtype: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # dense MLP width (dense layers)
    tie_embeddings: bool = False
    # MoE (experts == 0: dense model)
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in a MoE model
    # MLA (kv_lora_rank == 0: plain multi-head / grouped-query attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    sliding_layers: int = 0
    source: str = ""

    @classmethod
    def from_config(cls, name: str, cfg: Mapping[str, Any], dtype: str | None = None) -> ModelSpec:
        """Build from a HF config.json dict (or a catalog entry, which uses the same keys)."""
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        layers = int(cfg["num_hidden_layers"])
        dense_layers = int(cfg.get("first_k_dense_replace", 0)) if experts else 0
        if experts and int(cfg.get("decoder_sparse_step", 1)) > 1:
            # Qwen-MoE style: every n-th layer is MoE; count the rest as dense
            dense_layers = layers - layers // int(cfg["decoder_sparse_step"])
        sliding = int(cfg.get("sliding_window") or 0)
        sliding_layers = int(cfg.get("sliding_layers", 0))
        if sliding and not sliding_layers and isinstance(cfg.get("layer_types"), list):
            sliding_layers = sum(1 for t in cfg["layer_types"] if "sliding" in str(t))
        if not cfg.get("use_sliding_window", True) and "layer_types" not in cfg and "sliding_layers" not in cfg:
            sliding = 0  # Qwen configs carry a window they do not use
        raw_dtype = dtype or cfg.get("dtype") or _config_dtype(cfg)
        return cls(
            name=name,
            dtype=norm_dtype(str(raw_dtype)),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok", 0)) if experts else 0,
            shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
            if experts else 0,
            dense_layers=dense_layers,
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
            qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
            sliding_window=sliding if sliding_layers else 0,
            sliding_layers=sliding_layers if sliding else 0,
            source=str(cfg.get("source", "")),
        )

    # -- derived sizes (parameter counts, not bytes) --
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def attn_params_per_layer(self) -> int:
        h = self.hidden
        if self.is_mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank else h * self.heads * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * self.heads * (
                self.qk_nope_dim + self.v_head_dim)
            return q + kv + self.heads * self.v_head_dim * h
        return h * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate  # gate, up, down

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def shared_params(self) -> int:
        """Parameters every token reads: attention, dense MLPs, shared experts, routers (not embeddings)."""
        dense_mlp = (self.layers - self.moe_layers) * self.dense_mlp_params
        moe_fixed = self.moe_layers * (self.shared_experts * self.expert_params + self.hidden * self.experts)
        return self.layers * self.attn_params_per_layer + dense_mlp + moe_fixed

    @property
    def params(self) -> int:
        return self.shared_params + self.moe_layers * self.experts * self.expert_params + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches (the input embedding is a lookup, the LM head is counted)."""
        return self.shared_params + self.moe_layers * self.experts_per_token * self.expert_params + \
            self.vocab * self.hidden

    # attention widths: per head, for QK^T and for PV
    def attn_dims(self, decode: bool) -> tuple[int, int]:
        if self.is_mla:
            if decode:  # absorbed MLA: attention runs in the latent space
                return self.kv_lora_rank + self.qk_rope_dim, self.kv_lora_rank
            return self.qk_nope_dim + self.qk_rope_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    def kv_elems_per_token(self) -> int:
        if self.is_mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_dim)
        return self.layers * 2 * self.kv_heads * self.head_dim


def _config_dtype(cfg: Mapping[str, Any]) -> str:
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if "fp8" in method or q.get("fmt") == "e4m3":
        return "fp8"
    if "mxfp4" in method or "fp4" in method:
        return "fp4"
    return str(cfg.get("torch_dtype") or "bf16")


_BASIS = "# price basis:"


@cache
def price_basis() -> str:
    """What every catalog price is, as accelerators.csv's header states it (e.g. on-demand rental)."""
    with (_HERE / "accelerators.csv").open() as f:
        for line in f:
            if line.startswith(_BASIS):
                return line[len(_BASIS):].strip()
    raise ValueError("accelerators.csv states no price basis (a '# price basis:' header line)")


@cache
def _accelerators() -> dict[str, Accelerator]:
    out: dict[str, Accelerator] = {}
    with (_HERE / "accelerators.csv").open() as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        for r in rows:
            flops = {d: float(r[f"{d}_tflops"]) * 1e12 for d in ("bf16", "fp8", "fp4") if r[f"{d}_tflops"]}
            out[r["id"]] = Accelerator(
                id=r["id"], name=r["name"], vendor=r["vendor"], flops=flops,
                memory_bytes=float(r["memory_gb"]) * 1e9, memory_type=r["memory_type"],
                mem_bw=float(r["mem_bw_tb_s"]) * 1e12, scaleup_bw=float(r["scaleup_gb_s"]) * 1e9,
                scaleout_bw=float(r["scaleout_gb_s"]) * 1e9, confidence=r["confidence"], source=r["source"],
                usd_per_hour=float(r["usd_per_hour"]), price_confidence=r["price_confidence"],
                price_source=r["price_source"],
            )
    return out


@cache
def _model_table() -> dict[str, dict[str, Any]]:
    return tomllib.loads((_HERE / "models.toml").read_text())


def accelerators() -> dict[str, Accelerator]:
    return dict(_accelerators())


def accelerator(id: str) -> Accelerator:
    try:
        return _accelerators()[id]
    except KeyError:
        raise KeyError(f"unknown accelerator {id!r}; choose from {sorted(_accelerators())}") from None


def model_ids() -> list[str]:
    return sorted(_model_table())


@cache
def _from_file(path: str, dtype: str | None) -> ModelSpec:
    p = Path(path)
    return ModelSpec.from_config(p.parent.name or p.stem, json.loads(p.read_text()), dtype)


def model_spec(spec: str, dtype: str | None = None) -> ModelSpec:
    """A catalog id (e.g. "deepseek-r1") or a path to a HF config.json (or a directory holding one)."""
    table = _model_table()
    if spec in table:
        return ModelSpec.from_config(spec, table[spec], dtype)
    p = Path(spec)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return _from_file(str(p.resolve()), dtype)
    raise KeyError(f"unknown model spec {spec!r}: not a catalog id ({sorted(table)}) nor a config.json path")
