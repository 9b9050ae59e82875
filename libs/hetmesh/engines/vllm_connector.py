"""HetmeshConnector: vLLM's KV connector API (KVConnectorBase_V1) wired to the mesh's kv-transfer.

vLLM loads it by `kv_connector_module_path="hetmesh.engines.vllm_connector"`, inside its engine
core process; the worker shell around AsyncLLM (hetmesh.engines.vllm_engine) talks to it only
through files in a spool folder (tmpfs where there is one) named by each request's
`kv_transfer_params`:

- producer (`{"hetmesh": "save", "path": P}`, the PREFILL phase, max_tokens 1): in the step in
  which the prompt's prefill completes, after the forward pass, the request's KV blocks are
  gathered from every layer's paged cache and written to P as one safetensors file. The worker
  shell reads P and hands the bytes to the kv-transfer service.
- consumer (`{"hetmesh": "load", "path": P, "num_tokens": N}`, the DECODE phase): the worker
  shell writes the bytes that landed to P and submits prompt + first token; the scheduler side
  reports the first N tokens (the whole original prompt) as externally computed, so the
  scheduler allocates blocks without computing them, and before that step's forward pass the
  blocks are copied from P into the paged cache. Only the first generated token is computed.

It reads and writes the paged cache tensors vLLM registers (`register_kv_caches`) with plain
torch indexing on the block dimension, so it needs nothing from the attention metadata and works
on every platform vLLM runs on, the CPU included. One file holds one worker's layers (tensor
parallel ranks would each write their own shard; TP 1 is what runs here). On GPUs vLLM's
NixlConnector is the alternative (`kv_connector = "nixl"` in the cluster file): the KV then goes
by RDMA and kv-transfer only coordinates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

SAVE = "save"
LOAD = "load"


@dataclass
class _Op:
    request_id: str
    path: str
    block_ids: list[int]
    first_block: int = 0  # LOAD: blocks before this are a local prefix-cache hit and are left alone


@dataclass
class HetmeshConnectorMetadata(KVConnectorMetadata):
    saves: list[_Op] = field(default_factory=list)
    loads: list[_Op] = field(default_factory=list)


def _params(request: Request) -> dict[str, Any]:
    p = request.kv_transfer_params or {}
    return p if p.get("hetmesh") in (SAVE, LOAD) else {}


class HetmeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
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
        p = _params(request)
        if p.get("hetmesh") != LOAD:
            if p.get("hetmesh") == SAVE:
                self._producers[request.request_id] = request
            return 0, False
        if not os.path.exists(p["path"]):  # the worker shell writes it before submitting; never guess
            logger.warning("hetmesh: KV file %s for %s is missing; computing the prompt", p["path"],
                           request.request_id)
            return 0, False
        n = int(p["num_tokens"]) - num_computed_tokens
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
            meta.loads.append(_Op(rid, _params(req)["path"], list(manager.get_block_ids(rid)[0]), first))
        self._pending_loads.clear()
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self._producers.get(rid)
            # num_computed_tokens is still the value before this step here.
            if req is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            del self._producers[rid]
            need = -(-req.num_prompt_tokens // self._block_size)
            meta.saves.append(_Op(rid, _params(req)["path"], list(manager.get_block_ids(rid)[0])[:need]))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._producers.pop(request.request_id, None)
        loaded = self._loaded_tokens.pop(request.request_id, None)
        # Ends up in RequestOutput.kv_transfer_params: how many prompt tokens the connector supplied.
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
        logger.info("hetmesh connector: %d KV layers, e.g. %s", len(kv_caches),
                    next((tuple(t.shape) for t in kv_caches.values()), None))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HetmeshConnectorMetadata)
        for op in meta.loads:
            tensors = load_file(op.path)
            n = int(tensors.pop("hetmesh.num_blocks").item())
            for name, cache in self._caches.items():
                src = tensors[name]
                dim = self._block_dim[name]
                idx = torch.tensor(op.block_ids[op.first_block:n], dtype=torch.long, device=cache.device)
                part = src.narrow(dim, op.first_block, n - op.first_block).to(cache.device)
                cache.index_copy_(dim, idx, part)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once the step's forward pass has written every layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HetmeshConnectorMetadata)
        for op in meta.saves:
            idx = torch.tensor(op.block_ids, dtype=torch.long)
            out = {name: cache.index_select(self._block_dim[name], idx.to(cache.device)).cpu()
                   for name, cache in self._caches.items()}
            out["hetmesh.num_blocks"] = torch.tensor(len(op.block_ids))
            tmp = op.path + ".part"
            save_file(out, tmp)
            os.replace(tmp, op.path)  # the shell never sees half a file
