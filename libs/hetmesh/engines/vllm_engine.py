"""The `vllm` engine: vLLM's AsyncLLM inside the worker process, behind hetmesh.engines.base.

- submit -> `AsyncLLM.add_request` with the prompt's token ids (the gateway tokenized them with the
  model's own tokenizer.json), DELTA outputs; stream -> that request's output collector; abort ->
  `AsyncLLM.abort` (the engine frees the blocks; the stream ends "abort").
- Prefix caching is on. vLLM's KV-cache events (its ZMQ publisher, on an ipc:// socket in the
  spool folder) are mapped onto the mesh's one hashing scheme: every BlockStored carries the
  block's token ids and its parent's vLLM hash, so the engine chains
  `hetmesh.kvindex.blocks.next_block` from the parent's mesh digest and remembers vLLM hash ->
  mesh digest; BlockRemoved looks it up. The Redis index therefore holds exactly the hashes the
  gateway computes (vLLM's block size must equal the model's `block_size` in the cluster file).
- Stats (running, waiting, KV usage) come from a stat logger of ours that AsyncLLM calls every
  iteration; they feed the worker's heartbeats, and so does each step's shape and wall time (`step_log`,
  vLLM's iteration details; the context per sequence from the output processor's request states).
- P/D: PREFILL runs the prompt with max_tokens 1 as KV producer of HetmeshConnector
  (hetmesh.engines.vllm_connector), which leaves the KV in a file; `take_kv` returns its bytes for
  kv-transfer. DECODE gets the landed bytes by `put_kv`, then runs prompt + first token as KV
  consumer: vLLM computes only the first token's position and continues the same completion.

This module holds the engine itself: its lifecycle and the requests it tracks. Its parts lie beside it:
vllm_args (VllmConfig; vLLM's engine and sampling arguments), vllm_detok (its detokenizer's priming),
vllm_outputs (logprobs, stats and KV events in the mesh's terms) and vllm_spool (the spool folder's KV files
and the P/D hand-over's parameters).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from hetmesh.engines.base import EngineError, EngineOutput, EngineRequest, EngineStats, KvEventBatch
from hetmesh.kvstream import KvSink
from hetmesh.protocol import Phase, StepSample

from . import vllm_detok
from .vllm_args import VllmConfig, check_tp_pairings, engine_args, sampling_params
from .vllm_outputs import KvEventMapper, StepStats, stat_logger, token_logprobs
from .vllm_spool import KvSpool, consumer_params, frame

# Also imported from here: VllmConfig (hetmesh.engines.create, tests) and frame (tests, benchmarks/kv_frame.py).
__all__ = ["VllmConfig", "VllmEngine", "frame"]

log = logging.getLogger(__name__)


class _Track:
    __slots__ = ("collector", "first", "index", "kv_path", "prompt_tokens", "req", "started")

    def __init__(self, req: EngineRequest, collector: Any, kv_path: str | None) -> None:
        self.req = req
        self.collector = collector
        self.kv_path = kv_path
        # A migrated request's prompt ends with its completion so far (`continued`): numbered after it, and the
        # prompt's figures are the original prompt's. Greedy continues with the same text; a seeded sample
        # cannot (vLLM's generator starts afresh at the new worker, not at position `continued`).
        self.first = req.continued + len(req.first_token_ids)
        self.index = self.first  # position of the next token in the whole completion
        self.prompt_tokens = len(req.prompt_tokens) - req.continued
        self.started = False  # an output came back from the engine


class VllmEngine:
    name = "vllm"
    real_kv = True  # take_kv / put_kv move the engine's real KV bytes

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self.llm: Any = None
        self._stats = StepStats()
        self._tracks: dict[str, _Track] = {}
        self._mapper = KvEventMapper(config.model_name, config.block_size)
        self._pending_events = KvEventBatch()
        self._sub: Any = None
        self.spool = KvSpool(config.spool_dir)
        self.kv_blocks_total = 0
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.aborted = 0

    # ------------------------------------------------------------------ lifecycle
    def engine_args(self) -> Any:
        return engine_args(self.config, self.spool.path)

    async def start(self) -> None:
        import zmq
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401  (fail early with a clear import error)
        from vllm.v1.engine.async_llm import AsyncLLM

        check_tp_pairings(self.config)
        vllm_detok.install()  # continuations (migrations, a decode worker's prompt + first token) end mid-character
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        if self.config.kv_connector != "nixl":
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(self.config.cpu_reserved_cores))
        elif "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
            # NIXL's handshake port (named in the hand-over's remote_port): vLLM's default would collide between
            # two workers on one host; an operator's setting (and VLLM_NIXL_SIDE_CHANNEL_HOST) wins.
            with socket.socket() as sock:
                sock.bind(("", 0))
                os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(sock.getsockname()[1])
        # Subscribe before the engine binds: zmq connects to an ipc path that does not exist yet.
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(f"ipc://{self.spool.path}/kv-events")
        # Building the engine blocks (model load, KV cache allocation, engine-core process start).
        self.llm = AsyncLLM.from_engine_args(self.engine_args(), stat_loggers=[stat_logger(self._stats)])
        self._stats.requests = self.llm.output_processor.request_states
        cc = self.llm.vllm_config.cache_config
        self.kv_blocks_total = int(cc.num_gpu_blocks or 0)
        if cc.block_size != self.config.block_size:
            raise EngineError(f"vLLM runs block size {cc.block_size}, the cluster file says "
                              f"{self.config.block_size}: prefix hashes would never match")
        log.info("vllm engine up: %s, %d KV blocks of %d tokens, spool %s", self.config.model_dir,
                 self.kv_blocks_total, cc.block_size, self.spool.path)

    async def close(self) -> None:
        for rid in list(self._tracks):
            with contextlib.suppress(Exception):
                await self.abort(rid)
        self.spool.remove()  # first: vLLM's shutdown may outlast the launcher's patience (SIGKILL)
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ------------------------------------------------------------------ requests
    async def submit(self, request: EngineRequest) -> None:
        if self.llm is None:
            raise EngineError("vllm engine is not running")
        rid = request.request_id
        if rid in self._tracks:
            raise EngineError(f"request {rid} is already running here")
        prompt = list(request.prompt_tokens)
        params = sampling_params(request)
        path = None
        if request.phase == Phase.PREFILL and self.config.kv_connector:
            # vLLM's hand-over, whatever the connector: the output's kv_transfer_params go to the decode request.
            kvp: dict[str, Any] = {"do_remote_decode": True}
            if self.config.kv_connector == "hetmesh":
                path = kvp["hetmesh_path"] = self.spool.kv_path(rid)
            params.extra_args = {"kv_transfer_params": kvp}
        elif request.phase == Phase.DECODE:
            path = self.spool.pending.pop(rid, None)
            if self._first_tokens_ended(request):
                if path is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                self._tracks[rid] = _Track(request, None, None)  # stream ends at once, nothing to add
                return
            prompt += request.first_token_ids
            kvp = consumer_params(self.config.kv_connector, request.kv_transfer_params, path)
            if kvp is not None:
                params.extra_args = {"kv_transfer_params": kvp}
        total = len(prompt) + params.max_tokens
        if total > self.config.max_model_len:
            raise EngineError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                              f"the model's context of {self.config.max_model_len} tokens")
        from vllm.inputs import TokensPrompt

        try:
            collector = await self.llm.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params,
                                                   priority=request.priority)
        except ValueError as exc:  # vLLM's own validation (e.g. token ids out of vocabulary)
            raise EngineError(str(exc)) from exc
        self._tracks[rid] = _Track(request, collector, path)

    def _first_tokens_ended(self, req: EngineRequest) -> bool:
        """Did the prefill side's first token(s) already end the request (length, EOS, a stop string)?"""
        s = req.sampling
        first = req.first_token_ids
        if len(first) >= s.max_tokens:
            return True
        tok = self.llm.tokenizer
        if not s.ignore_eos and tok is not None and first and first[-1] == tok.eos_token_id:
            return True
        return bool(s.stop and tok is not None and any(x in tok.decode(first) for x in s.stop))

    async def stream(self, request_id: str) -> AsyncIterator[EngineOutput]:
        t = self._tracks.get(request_id)
        if t is None:
            raise EngineError(f"unknown request {request_id}")
        req = t.req
        if t.collector is None:
            self._forget(t)
            yield EngineOutput(request_id=request_id, index=t.index, token_ids=[], text="", finished=True,
                               finish_reason="stop", prompt_tokens=t.prompt_tokens,
                               completion_tokens=t.index)
            return
        try:
            while True:
                try:
                    out = await t.collector.get()
                    t.started = True
                except Exception:  # the engine died or refused the request
                    log.exception("vllm request %s failed", request_id)
                    self._forget(t)
                    yield EngineOutput(request_id=request_id, index=t.index, token_ids=[], text="", finished=True,
                                       finish_reason="error", prompt_tokens=t.prompt_tokens,
                                       completion_tokens=t.index, cached_tokens=0)
                    return
                c = out.outputs[0] if out.outputs else None
                ids = list(c.token_ids) if c is not None else []
                lps = token_logprobs(c, ids, req.sampling.logprobs) if c is not None else None
                text = c.text if c is not None else ""
                reason = c.finish_reason if c is not None else None
                cached = out.num_cached_tokens or 0
                index = t.index
                t.index += len(ids)
                self.tokens_generated += len(ids)
                finished = bool(out.finished)
                handover = None
                if finished and req.phase == Phase.PREFILL:
                    handover = self.spool.handover(request_id, out.kv_transfer_params)
                if finished:
                    self._account(t, cached, reason)
                    self._forget(t)  # before the last yield: a consumer may stop iterating at it
                    if req.phase == Phase.PREFILL and reason != "abort":
                        # max_tokens 1 ended it; the request itself ends only on a real stop or its own limit.
                        real = reason == "stop" or req.sampling.max_tokens <= 1
                        reason = reason if real else None
                    if req.phase == Phase.DECODE and not ids and t.index == t.first:
                        reason = reason or "stop"
                # The decode engine's prompt includes the first tokens; report the original prompt's figures.
                yield EngineOutput(request_id=request_id, index=index, token_ids=ids, text=text, finished=finished,
                                   finish_reason=reason, prompt_tokens=t.prompt_tokens,
                                   cached_tokens=min(cached, t.prompt_tokens), completion_tokens=t.index,
                                   logprobs=lps, kv_transfer_params=handover)
                if finished:
                    return
        finally:
            self._forget(t)

    def _forget(self, t: _Track) -> None:
        rid = t.req.request_id
        if self._tracks.get(rid) is not t:
            return
        del self._tracks[rid]
        if t.req.phase == Phase.DECODE and t.kv_path:
            self.spool.recycle(t.kv_path)

    def _account(self, t: _Track, cached: int, reason: str | None) -> None:
        if reason == "abort":
            self.aborted += 1
        prompt = t.prompt_tokens + t.first  # what the engine was given
        self.prompt_tokens_cached += min(cached, prompt)
        self.prompt_tokens_computed += max(0, prompt - cached)

    def started(self, request_id: str) -> bool:
        # vLLM says nothing of a request before its first output: one whose prefill is under way (not its first
        # chunk done) counts as not started, so a withdrawal can cost that much of its prefill, never its tokens.
        t = self._tracks.get(request_id)
        return t is not None and t.started

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._tracks or self.llm is None:
            return False
        await self.llm.abort(request_id)
        return True

    # ------------------------------------------------------------------ KV bytes for disaggregation
    def take_kv(self, request_id: str) -> bytes | memoryview | None:
        return self.spool.take(request_id)

    def put_kv(self, request_id: str, data: bytes | bytearray | memoryview) -> None:
        self.spool.put(request_id, data)

    def kv_sink(self, request_id: str, nbytes: int) -> KvSink:
        return self.spool.sink(request_id, nbytes)

    # ------------------------------------------------------------------ stats and events
    def stats(self) -> EngineStats:
        s = self._stats
        total = self.kv_blocks_total
        return EngineStats(waiting=s.waiting, running=s.running, max_batch=self.config.max_batch,
                           kv_blocks_total=total, kv_blocks_used=round(s.kv_usage * total),
                           kv_blocks_cached=len(self._mapper.digests), block_size=self.config.block_size,
                           tokens_generated=self.tokens_generated, prompt_tokens_computed=self.prompt_tokens_computed,
                           prompt_tokens_cached=self.prompt_tokens_cached, aborted=self.aborted, steps=s.steps,
                           busy_s=s.seconds)

    def step_log(self) -> list[StepSample]:
        """The steps since the last call (vLLM's per-iteration details via our stat logger), at most StepLog's cap."""
        return self._stats.log.drain()

    def kv_events(self) -> KvEventBatch:
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        out, self._pending_events = self._pending_events, KvEventBatch()
        if self._sub is None:
            return out
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        while True:
            try:
                _topic, _seq, payload = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._mapper.apply(dec.decode(payload).events, out)
        # Net change: a block stored then removed within one drain cancels out.
        both = set(out.stored) & set(out.removed)
        if both:
            out.stored = [h for h in out.stored if h not in both]
            out.removed = [h for h in out.removed if h not in both]
        return out
