"""What the `vllm` engine (hetmesh.engines.vllm_engine) hands vLLM, built from our own terms: its
configuration (`VllmConfig`), vLLM's engine arguments for it, the start-up check of its P/D TP pairings,
and each request's SamplingParams. Functions of their inputs only, kept apart from the engine's
request and KV bookkeeping; vLLM is imported inside them so that this module loads without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from hetmesh.engines.base import EngineError, EngineRequest
from hetmesh.protocol import Phase

from .vllm_kv import tp_pairing_problem

CONNECTOR_MODULE = "hetmesh.engines.vllm_connector"


class VllmConfig(msgspec.Struct, kw_only=True):
    model_dir: str  # a HF model folder (config.json, weights, tokenizer)
    model_name: str  # the mesh's model name: seeds the block-hash chain like the gateway's
    block_size: int = 128  # vLLM's KV block size; must equal the cluster file's model block_size
    max_batch: int = 64
    step_tokens: int = 8192  # vLLM's max_num_batched_tokens: the worker group's step budget
    max_model_len: int = 2048
    dtype: str = "auto"
    kv_cache_gib: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE (whole GiB); GPUs size the cache by gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    # "hetmesh" (ours, any platform: bytes go through kv-transfer) or "nixl" (vLLM's NixlConnector,
    # RDMA between GPUs; kv-transfer then only coordinates). Empty: no connector (aggregated only).
    kv_connector: str = "hetmesh"
    spool_dir: str = ""  # where KV files and the events socket live; default a fresh folder in /dev/shm
    seed: int = 0
    # CPU: cores kept free of vLLM's OpenMP threads for the worker shell, NATS and the other services.
    # vLLM reserves one core per rank, plus one more whenever a KV connector is set (for NIXL's
    # threads); ours needs none, and on a small host that extra reservation would leave OpenMP on
    # every core, where each token's trip through the mesh preempts a thread and stalls the step.
    cpu_reserved_cores: int = 1
    compact_json: bool = True  # structured outputs without free whitespace (the engine-wide setting in vLLM)
    # The TP sizes of the engines this one hands KV to or takes it from (the cluster's other P/D groups of the
    # model): a pairing our connector's KV layout does not allow is refused at start (vllm_kv.tp_pairing_problem).
    peer_tp_sizes: list[int] = msgspec.field(default_factory=list)


def engine_args(c: VllmConfig, spool: Path) -> Any:
    """vLLM's AsyncEngineArgs for `c`; its KV-cache events are published on an ipc socket in `spool`."""
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kv_transfer = None
    if c.kv_connector == "hetmesh":
        kv_transfer = KVTransferConfig(kv_connector="HetmeshConnector", kv_connector_module_path=CONNECTOR_MODULE,
                                       kv_role="kv_both")
    elif c.kv_connector == "nixl":
        kv_transfer = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    elif c.kv_connector:
        raise EngineError(f"unknown kv_connector {c.kv_connector!r} (hetmesh | nixl | empty)")
    from vllm.config import StructuredOutputsConfig

    extra: dict[str, Any] = {}
    if c.compact_json:  # needs a named backend (vLLM refuses it with "auto"); xgrammar is auto's first choice
        extra["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar",
                                                                     disable_any_whitespace=True)
    return AsyncEngineArgs(**extra,
        model=c.model_dir, tokenizer=c.model_dir, dtype=c.dtype, max_model_len=c.max_model_len,
        block_size=c.block_size, max_num_seqs=c.max_batch, max_num_batched_tokens=c.step_tokens,
        enable_prefix_caching=True,
        scheduling_policy="priority",  # the request's priority (InferenceRequest.priority); all 0 is first-come
        enforce_eager=c.enforce_eager, tensor_parallel_size=c.tensor_parallel_size,
        gpu_memory_utilization=c.gpu_memory_utilization, seed=c.seed, disable_log_stats=True,
        enable_logging_iteration_details=True,  # each step's shape and wall time reach our stat logger
        kv_transfer_config=kv_transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                        endpoint=f"ipc://{spool}/kv-events"))


def check_tp_pairings(c: VllmConfig) -> None:
    """Refuse, before loading anything, a P/D pairing whose KV our connector cannot re-lay."""
    if c.kv_connector != "hetmesh" or not c.peer_tp_sizes:
        return
    try:
        hf = json.loads((Path(c.model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read {c.model_dir}/config.json: {exc}") from exc
    heads = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    for peer in sorted(set(c.peer_tp_sizes)):
        problem = tp_pairing_problem(c.tensor_parallel_size, peer, heads)
        if problem:
            raise EngineError(f"kv_connector hetmesh, this engine's TP {c.tensor_parallel_size} with a peer's "
                              f"TP {peer}: {problem}")


def sampling_params(req: EngineRequest) -> Any:
    """vLLM's SamplingParams for one request: PREFILL computes the first token only; DECODE the rest."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = req.sampling
    done = len(req.first_token_ids)
    max_tokens = s.max_tokens - done
    if req.phase == Phase.PREFILL:
        max_tokens = 1
    max_tokens = max(1, max_tokens)
    structured = None
    if s.structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        so = s.structured
        structured = (StructuredOutputsParams(json=so.json_schema) if so.json_schema
                      else StructuredOutputsParams(json_object=True))
    # Every option the gateway accepted, as vLLM names it (the gateway refused what vLLM lacks).
    return SamplingParams(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p,
                          seed=s.seed, stop=list(s.stop) or None, ignore_eos=s.ignore_eos,
                          top_k=s.top_k, min_p=s.min_p,
                          presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                          repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias) or None,
                          min_tokens=min(max(0, s.min_tokens - done - req.continued), max_tokens),
                          stop_token_ids=list(s.stop_token_ids) or None, logprobs=s.logprobs,
                          structured_outputs=structured,
                          output_kind=RequestOutputKind.DELTA, skip_special_tokens=s.skip_special_tokens)
