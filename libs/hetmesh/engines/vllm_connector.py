"""HetmeshConnector: vLLM's KV connector API (KVConnectorBase_V1) wired to the mesh's kv-transfer.

vLLM loads it by `kv_connector_module_path="hetmesh.engines.vllm_connector"`, inside its engine
core process (scheduler side) and in every tensor-parallel worker (worker side). It follows vLLM's
own P/D hand-over, the one NixlConnector uses, so the mesh carries one thing for both connectors:

- producer (the PREFILL phase, max_tokens 1): the request's kv_transfer_params are
  `{"do_remote_decode": True, "hetmesh_path": P}`. In the step in which the prompt's prefill
  completes, after the forward pass, every TP rank gathers the request's KV blocks from each of its
  layers' paged caches (its shard: its slice of the KV heads) and writes them to `P.rank<r>` as one
  safetensors file. The finished request's output carries `{"do_remote_prefill": True, "hetmesh":
  {"path": P, "num_tokens": N, "tp_size": p, "num_kv_heads": H}}`; the worker shell adds the
  shards' sizes, sends the shards back to back as one stream (the "frame") and hands these params
  through the mesh (KvTransferRequest -> KvLanded) to the decode request.
- consumer (the DECODE phase): the decode request gets those params, the path replaced by the
  landed frame's. The scheduler side reports the first N tokens (the whole original prompt) as
  externally computed; before that step's forward pass each decode rank reads the shard(s) holding
  its heads from the frame and copies their blocks into its paged cache. Only the first generated
  token is computed.

Prefill and decode TP sizes may differ where the KV heads split into contiguous slices on both
sides (both sizes divide the model's KV heads): a decode rank then takes its heads from one or
several prefill shards. Where a size exceeds the KV heads (vLLM replicates heads across ranks) the
sizes must be equal; `tp_pairing_problem` says so, and the engine refuses such a pairing at start.

It reads and writes the paged cache tensors vLLM registers (`register_kv_caches`) with plain torch
indexing on the block dimension, so it needs nothing from the attention metadata and works on every
platform vLLM runs on, the CPU included; both sides must use the same attention backend's layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load, save
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from hetmesh.engines.vllm_kv import shard_path, shard_sources, tp_pairing_problem

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)



def gather_blocks(caches: dict[str, torch.Tensor], block_dim: dict[str, int], block_ids: list[int]) -> bytes:
    """One rank's shard: these blocks of every layer, as a safetensors file's bytes."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    out = {name: cache.index_select(block_dim[name], idx.to(cache.device)).cpu() for name, cache in caches.items()}
    out["hetmesh.num_blocks"] = torch.tensor(len(block_ids))
    return save(out)


def read_shards(path: str, shard_bytes: list[int], wanted: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The wanted prefill shards out of a landed frame (the shards back to back, sizes `shard_bytes`)."""
    out = {}
    with open(path, "rb") as f:
        for s in wanted:
            f.seek(sum(shard_bytes[:s]))
            out[s] = load(f.read(shard_bytes[s]))
    return out


def scatter_blocks(caches: dict[str, torch.Tensor], block_dim: dict[str, int], shards: dict[int, dict[str, torch.Tensor]],
                   sources: list[tuple[int, int, int]], block_ids: list[int], first_block: int) -> None:
    """Copy the landed blocks [first_block, n) into this rank's caches at `block_ids`, its KV heads
    taken from the prefill shards `sources` names (`shard_sources`)."""
    n = int(next(iter(shards.values()))["hetmesh.num_blocks"].item())
    for name, cache in caches.items():
        dim = block_dim[name]
        parts = [shards[s][name] for s, _, _ in sources]
        if len(sources) > 1 or parts[0].dim() != cache.dim() or any(
                a != b for i, (a, b) in enumerate(zip(parts[0].shape, cache.shape, strict=True)) if i != dim):
            heads = _head_dim(cache.shape, parts[0].shape, dim, sum(k for _, _, k in sources))
            parts = [t.narrow(heads, first, k) for t, (_, first, k) in zip(parts, sources, strict=True)]
            src = torch.cat(parts, dim=heads) if len(parts) > 1 else parts[0]
        else:
            src = parts[0]
        idx = torch.tensor(block_ids[first_block:n], dtype=torch.long, device=cache.device)
        cache.index_copy_(dim, idx, src.narrow(dim, first_block, n - first_block).to(cache.device))


def _head_dim(cache: torch.Size, shard: torch.Size, block_dim: int, local_heads: int) -> int:
    """The KV-heads dimension: where this rank's cache and a prefill shard differ (other than in blocks)."""
    same_rank = len(cache) == len(shard)
    dims = [i for i in range(len(cache)) if same_rank and i != block_dim and cache[i] == local_heads
            and shard[i] != cache[i]]
    if len(dims) != 1 or any(
            cache[i] != shard[i] for i in range(len(cache)) if i not in (block_dim, dims[0])):
        raise RuntimeError(f"hetmesh connector: cannot tell the KV-heads dimension of {tuple(cache)} "
                           f"(prefill shard {tuple(shard)}): the two sides' KV layouts differ")
    return dims[0]


@dataclass
class _Op:
    request_id: str
    params: dict[str, Any]  # the request's "hetmesh" kv_transfer_params (LOAD) or {"path": P} (SAVE)
    block_ids: list[int]
    first_block: int = 0  # LOAD: blocks before this are a local prefix-cache hit and are left alone


@dataclass
class HetmeshConnectorMetadata(KVConnectorMetadata):
    saves: list[_Op] = field(default_factory=list)
    loads: list[_Op] = field(default_factory=list)


def _producer(request: Request) -> str | None:
    p = request.kv_transfer_params or {}
    return p.get("hetmesh_path") if p.get("do_remote_decode") else None


def _consumer(request: Request) -> dict[str, Any] | None:
    p = request.kv_transfer_params or {}
    h = p.get("hetmesh")
    return h if p.get("do_remote_prefill") and isinstance(h, dict) else None


class HetmeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        self._kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        # scheduler side
        self._producers: dict[str, Request] = {}  # waiting for their prefill to complete
        self._pending_loads: dict[str, tuple[Request, int]] = {}  # -> (request, first block to load)
        self._loaded_tokens: dict[str, int] = {}
        self._local_hit: dict[str, int] = {}  # tokens the local prefix cache had when asked
        # worker side
        self._caches: dict[str, torch.Tensor] = {}
        self._block_dim: dict[str, int] = {}

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        h = _consumer(request)
        if h is None:
            if _producer(request) is not None:
                self._producers[request.request_id] = request
            return 0, False
        problem = tp_pairing_problem(int(h.get("tp_size", 1)), self._tp, self._kv_heads)
        if problem or not os.path.exists(h["path"]):  # the worker shell writes it before submitting; never guess
            logger.warning("hetmesh: KV for %s unusable (%s); computing the prompt", request.request_id,
                           problem or f"{h['path']} is missing")
            return 0, False
        n = int(h["num_tokens"]) - num_computed_tokens
        self._local_hit[request.request_id] = num_computed_tokens  # block aligned
        return max(0, n), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        local = self._local_hit.pop(request.request_id, 0)
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = (request, local // self._block_size)
            self._loaded_tokens[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HetmeshConnectorMetadata()
        manager = self._kv_cache_manager
        assert manager is not None, "vLLM binds the KV cache manager before scheduling"
        for rid, (req, first) in self._pending_loads.items():
            h = _consumer(req)
            assert h is not None
            meta.loads.append(_Op(rid, h, list(manager.get_block_ids(rid)[0]), first))
        self._pending_loads.clear()
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self._producers.get(rid)
            # num_computed_tokens is still the value before this step here.
            if req is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            del self._producers[rid]
            need = -(-req.num_prompt_tokens // self._block_size)
            meta.saves.append(_Op(rid, {"path": _producer(req)}, list(manager.get_block_ids(rid)[0])[:need]))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._producers.pop(request.request_id, None)
        loaded = self._loaded_tokens.pop(request.request_id, None)
        path = _producer(request)
        if path is not None and request.num_computed_tokens >= request.num_prompt_tokens:
            # vLLM's hand-over, in RequestOutput.kv_transfer_params: what the decode request is given.
            return False, {"do_remote_prefill": True, "do_remote_decode": False,
                           "hetmesh": {"path": path, "num_tokens": request.num_prompt_tokens, "tp_size": self._tp,
                                       "num_kv_heads": self._kv_heads}}
        # A consumer: how many prompt tokens the connector supplied.
        return False, ({"hetmesh_loaded_tokens": loaded} if loaded is not None else None)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, t in kv_caches.items():
            dims = [i for i, s in enumerate(t.shape) if s == self._num_blocks]
            if not dims:
                raise RuntimeError(f"hetmesh connector: no block dimension of size {self._num_blocks} in "
                                   f"{name}'s KV cache {tuple(t.shape)}")
            self._caches[name] = t
            self._block_dim[name] = dims[0]
        logger.info("hetmesh connector: rank %d of %d, %d KV layers, e.g. %s", _rank(), self._tp, len(kv_caches),
                    next((tuple(t.shape) for t in kv_caches.values()), None))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HetmeshConnectorMetadata)
        rank = _rank()
        for op in meta.loads:
            h = op.params
            sources = shard_sources(rank, self._tp, int(h.get("tp_size", 1)), self._kv_heads)
            shards = read_shards(h["path"], [int(x) for x in h["shard_bytes"]], [s for s, _, _ in sources])
            scatter_blocks(self._caches, self._block_dim, shards, sources, op.block_ids, op.first_block)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once the step's forward pass has written every layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HetmeshConnectorMetadata)
        for op in meta.saves:
            path = shard_path(op.params["path"], _rank())
            with open(path + ".part", "wb") as f:
                f.write(gather_blocks(self._caches, self._block_dim, op.block_ids))
            os.replace(path + ".part", path)  # the shell never sees half a file


def _rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
