"""The narrow engine interface the worker shell drives.

It is deliberately small so that vLLM's `AsyncLLM` sits behind it (hetmesh.engines.vllm_engine):
`submit` maps to `AsyncLLM.add_request`, `stream` to its per-request output collector, `abort` to
`abort`, and `kv_events` to vLLM's KV-cache event publisher (BlockStored / BlockRemoved /
AllBlocksCleared). `take_kv` / `put_kv` carry the real KV bytes of a disaggregated request for
engines that have them (`real_kv`); the sim engine only simulates their size.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from msgspec import Struct, field

from hetmesh.batching.cache import KvEventBatch
from hetmesh.kvstream import KvSink
from hetmesh.protocol import Phase, SamplingParams, StepSample, TokenLogprob


class EngineError(Exception):
    """The engine cannot take or finish a request (e.g. it can never fit in the KV cache)."""


class EngineRequest(Struct, kw_only=True):
    request_id: str
    prompt_tokens: list[int]
    block_hashes: list[int]  # hetmesh.kvindex.blocks.block_hashes of the prompt: the one scheme in the mesh
    sampling: SamplingParams
    phase: Phase = Phase.FULL
    # DECODE: the token(s) the prefill side generated; their KV and the prompt's have landed.
    first_token_ids: list[int] = field(default_factory=list)
    # A migrated request (protocol.InferenceRequest.continued): the last `continued` prompt tokens are its
    # own completion so far; outputs number from there and count them, and the prompt's usage excludes them.
    continued: int = 0
    # DECODE: the prefill output's kv_transfer_params (vLLM's hand-over), for the engine's KV connector.
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0  # protocol.InferenceRequest.priority: the engine's queue serves lower values first


class EngineOutput(Struct, kw_only=True):
    """New tokens since the previous output of this request (outputs of several steps may be merged)."""

    request_id: str
    index: int  # position of token_ids[0] in the completion
    token_ids: list[int]
    text: str  # new text; stop strings and text that may still become one are held back
    finished: bool = False  # the last output of this stream
    # "stop" | "length" | "abort" | "error" (the engine failed); None on a finished PREFILL stream
    # that handed off to decode
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from this engine's prefix cache
    completion_tokens: int = 0  # completion length so far, including DECODE's first tokens
    queued_s: float = 0.0  # wall seconds from submit to the request's first engine step (metrics, traces)
    logprobs: list[TokenLogprob] | None = None  # per token id, when the request asked for them
    # A finished PREFILL: its KV connector's kv_transfer_params (vLLM's RequestOutput field), for the decode side.
    kv_transfer_params: dict[str, Any] | None = None


class EngineStats(Struct, kw_only=True):
    waiting: int
    running: int
    max_batch: int
    kv_blocks_total: int
    kv_blocks_used: int  # pinned by running requests (evictable cached blocks count as free)
    kv_blocks_cached: int  # blocks holding a prefix (pinned or evictable)
    block_size: int
    tokens_generated: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    aborted: int = 0
    preempted: int = 0  # requests whose KV was dropped to make room (they recompute it later)
    steps: int = 0
    busy_s: float = 0.0  # wall seconds the engine spent in steps, in all (what is not a step is a request's gap)


class Engine(Protocol):
    name: str
    real_kv: bool  # take_kv / put_kv move real KV bytes (else the worker sends the cost model's size)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def submit(self, request: EngineRequest) -> None:
        """Queue a request; raises EngineError when it can never run here."""
        ...

    def stream(self, request_id: str) -> AsyncIterator[EngineOutput]:
        """Outputs of a submitted request until (and including) the one with finished=True."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Stop computing the request now; its stream ends with finish_reason "abort". False if unknown."""
        ...

    def started(self, request_id: str) -> bool:
        """Whether the engine has begun computing the request (a withdrawn placement is dropped only before);
        False when it does not hold it."""
        ...

    def stats(self) -> EngineStats: ...

    def step_log(self) -> list[StepSample]:
        """Drain the engine steps since the previous call (a bounded sample: hetmesh.costmodel.learn.StepLog), each
        with its totals and seconds, for the scheduler's online fit of this worker's speed."""
        ...

    def kv_events(self) -> KvEventBatch:
        """Drain the prefix cache's stored/removed block hashes since the previous call."""
        ...

    def take_kv(self, request_id: str) -> bytes | memoryview | None:
        """The KV a finished PREFILL left, as bytes to ship (once); None when the engine has none."""
        ...

    def kv_sink(self, request_id: str, nbytes: int) -> KvSink:
        """Where a DECODE's KV lands straight from the socket (hetmesh.kvstream); `commit` hands it over
        like put_kv. Raises ValueError when the engine cannot take nbytes now."""
        ...

    def put_kv(self, request_id: str, data: bytes) -> None:
        """KV bytes that landed for a DECODE, before it is submitted."""
        ...
