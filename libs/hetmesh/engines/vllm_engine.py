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
  iteration; they feed the worker's heartbeats.
- P/D: PREFILL runs the prompt with max_tokens 1 as KV producer of HetmeshConnector
  (hetmesh.engines.vllm_connector), which leaves the KV in a file; `take_kv` returns its bytes for
  kv-transfer. DECODE gets the landed bytes by `put_kv`, then runs prompt + first token as KV
  consumer: vLLM computes only the first token's position and continues the same completion.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from hetmesh.engines.base import EngineError, EngineOutput, EngineRequest, EngineStats, KvEventBatch
from hetmesh.kvindex.blocks import digest_int, next_block
from hetmesh.protocol import Phase, TokenLogprob

from .vllm_kv import shard_path, tp_pairing_problem

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "hetmesh.engines.vllm_connector"
FREE_KV_FILES = 8
FREE_KV_BYTES = 1 << 30


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


SPOOL_PREFIX = "hetmesh-vllm-"


def _logprobs(c: Any, ids: list[int], k: int | None) -> list[TokenLogprob] | None:
    """vLLM's per-position {token id: Logprob(logprob, rank)} (the drawn token and the top k) as ours."""
    if k is None or c.logprobs is None:
        return None
    out = []
    for i, tok in enumerate(ids):
        d = c.logprobs[i]
        top = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank is not None and lp.rank <= k)
        drawn = d.get(tok)
        out.append(TokenLogprob(tok, drawn.logprob if drawn is not None else -9999.0, [(t, x) for _, t, x in top]))
    return out


def _spool_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _sweep_dead_spools() -> None:
    """Remove spool folders whose worker process is gone (killed before it could clean up)."""
    root = Path(_spool_root() or tempfile.gettempdir())
    for d in root.glob(f"{SPOOL_PREFIX}*-*"):
        pid = d.name[len(SPOOL_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


class _Stats:
    """The last SchedulerStats AsyncLLM reported (a StatLoggerBase made by `_stat_logger`)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.steps = 0


def _stat_logger(sink: _Stats) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class HetmeshStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.sink = sink

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                self.sink.running = scheduler_stats.num_running_reqs
                self.sink.waiting = scheduler_stats.num_waiting_reqs
                self.sink.kv_usage = scheduler_stats.kv_cache_usage
                self.sink.steps += 1

        def log_engine_initialized(self) -> None:
            return

    return HetmeshStatLogger


class _KvEventMapper:
    """vLLM block hash -> mesh block digest, fed by vLLM's KV-cache events."""

    def __init__(self, model: str, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.digests: dict[bytes | int, bytes] = {}

    def apply(self, events: list[Any], out: KvEventBatch) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        bs = self.block_size
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.block_size != bs or ev.lora_name or (ev.extra_keys and any(ev.extra_keys)):
                    continue  # not addressable by token ids alone: the gateway could never match it
                parent = None
                if ev.parent_block_hash is not None:
                    parent = self.digests.get(ev.parent_block_hash)
                    if parent is None:
                        continue  # its prefix is unknown to us (e.g. stored before we subscribed)
                for i, h in enumerate(ev.block_hashes):
                    tokens = ev.token_ids[i * bs:(i + 1) * bs]
                    if len(tokens) < bs:
                        break
                    parent = next_block(self.model, parent, tokens)
                    self.digests[h] = parent
                    out.stored.append(digest_int(parent))
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    d = self.digests.pop(h, None)
                    if d is not None:
                        out.removed.append(digest_int(d))
            elif isinstance(ev, AllBlocksCleared):
                self.digests.clear()
                out.stored.clear()
                out.removed.clear()
                out.cleared = True


class _Track:
    __slots__ = ("collector", "first", "index", "kv_path", "prompt_tokens", "req")

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


class _FileSink:
    """A KV file in the spool folder, mapped for the KV stream to fill (hetmesh.kvstream.KvSink)."""

    def __init__(self, engine: VllmEngine, request_id: str, path: str, nbytes: int) -> None:
        self.engine, self.request_id, self.path = engine, request_id, path
        # A landed file already loaded by its request, renamed: its tmpfs pages are reused instead of
        # allocated and zeroed anew, which on a VM costs as much as the transfer itself.
        reused = engine._reuse_kv_file(nbytes)
        if reused is not None:
            os.replace(reused, path + ".part")
        self._fd = os.open(path + ".part", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self._fd).st_size > nbytes:
                os.ftruncate(self._fd, nbytes)
            os.posix_fallocate(self._fd, 0, nbytes)  # tmpfs full fails here, not as SIGBUS mid-stream
            self._map = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            self.discard()
            raise ValueError(f"no room for {nbytes} bytes of KV in {engine.spool}: {exc}") from exc
        self.view: memoryview | None = memoryview(self._map)

    def _close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        with contextlib.suppress(AttributeError, BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def commit(self) -> None:
        self._close()
        os.replace(self.path + ".part", self.path)
        self.engine._pending_kv[self.request_id] = self.path

    def discard(self) -> None:
        self._close()
        with contextlib.suppress(OSError):
            os.unlink(self.path + ".part")


def frame(shards: list[str]) -> bytes | memoryview:
    """The shard files as one stream. One shard (TP 1) is mapped, its tmpfs pages sent as they are, never
    copied; several are read into one buffer (one copy, no join) so that the transfer stays one stream."""
    if len(shards) > 1:
        sizes = [os.stat(p).st_size for p in shards]
        buf = bytearray(sum(sizes))
        view, at = memoryview(buf), 0
        for p, n in zip(shards, sizes, strict=True):
            end = at + n
            with open(p, "rb", buffering=0) as f:
                while at < end:
                    got = f.readinto(view[at:end])
                    if not got:
                        raise FileNotFoundError(f"KV shard {p} shrank while read")
                    at += got
        return view
    with open(shards[0], "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return (memoryview(mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                     prot=mmap.PROT_READ)) if size else memoryview(b""))


class VllmEngine:
    name = "vllm"
    real_kv = True  # take_kv / put_kv move the engine's real KV bytes

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self.llm: Any = None
        self._stats = _Stats()
        self._tracks: dict[str, _Track] = {}
        self._pending_kv: dict[str, str] = {}  # DECODE request id -> landed KV file, until submitted
        self._prefill_kv: dict[str, list[str]] = {}  # finished PREFILL request id -> its TP ranks' KV shards
        self._free_kv: list[tuple[int, str]] = []  # (size, path): landed KV files already loaded, for reuse
        self._mapper = _KvEventMapper(config.model_name, config.block_size)
        self._pending_events = KvEventBatch()
        self._sub: Any = None
        self._own_spool = not config.spool_dir
        if self._own_spool:
            _sweep_dead_spools()
        self.spool = Path(config.spool_dir or tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-", dir=_spool_root()))
        self.kv_blocks_total = 0
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.aborted = 0

    # ------------------------------------------------------------------ lifecycle
    def engine_args(self) -> Any:
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        c = self.config
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
            enforce_eager=c.enforce_eager, tensor_parallel_size=c.tensor_parallel_size,
            gpu_memory_utilization=c.gpu_memory_utilization, seed=c.seed, disable_log_stats=True,
            kv_transfer_config=kv_transfer,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=f"ipc://{self.spool}/kv-events"))

    def check_tp_pairings(self) -> None:
        """Refuse, before loading anything, a P/D pairing whose KV our connector cannot re-lay."""
        c = self.config
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

    async def start(self) -> None:
        import zmq
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401  (fail early with a clear import error)
        from vllm.v1.engine.async_llm import AsyncLLM

        self.check_tp_pairings()
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
        self._sub.connect(f"ipc://{self.spool}/kv-events")
        # Building the engine blocks (model load, KV cache allocation, engine-core process start).
        self.llm = AsyncLLM.from_engine_args(self.engine_args(), stat_loggers=[_stat_logger(self._stats)])
        cc = self.llm.vllm_config.cache_config
        self.kv_blocks_total = int(cc.num_gpu_blocks or 0)
        if cc.block_size != self.config.block_size:
            raise EngineError(f"vLLM runs block size {cc.block_size}, the cluster file says "
                              f"{self.config.block_size}: prefix hashes would never match")
        log.info("vllm engine up: %s, %d KV blocks of %d tokens, spool %s", self.config.model_dir,
                 self.kv_blocks_total, cc.block_size, self.spool)

    async def close(self) -> None:
        for rid in list(self._tracks):
            with contextlib.suppress(Exception):
                await self.abort(rid)
        if self._own_spool:  # first: vLLM's shutdown may outlast the launcher's patience (SIGKILL)
            shutil.rmtree(self.spool, ignore_errors=True)
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ------------------------------------------------------------------ requests
    def _kv_path(self, request_id: str) -> str:
        return str(self.spool / f"{request_id}.{uuid.uuid4().hex[:8]}.kv")

    def sampling_params(self, req: EngineRequest) -> Any:
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

    async def submit(self, request: EngineRequest) -> None:
        if self.llm is None:
            raise EngineError("vllm engine is not running")
        rid = request.request_id
        if rid in self._tracks:
            raise EngineError(f"request {rid} is already running here")
        prompt = list(request.prompt_tokens)
        params = self.sampling_params(request)
        path = None
        if request.phase == Phase.PREFILL and self.config.kv_connector:
            # vLLM's hand-over, whatever the connector: the output's kv_transfer_params go to the decode request.
            kvp: dict[str, Any] = {"do_remote_decode": True}
            if self.config.kv_connector == "hetmesh":
                path = kvp["hetmesh_path"] = self._kv_path(rid)
            params.extra_args = {"kv_transfer_params": kvp}
        elif request.phase == Phase.DECODE:
            path = self._pending_kv.pop(rid, None)
            if self._first_tokens_ended(request):
                if path is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                self._tracks[rid] = _Track(request, None, None)  # stream ends at once, nothing to add
                return
            prompt += request.first_token_ids
            kvp = self._consumer_params(request.kv_transfer_params, path)
            if kvp is not None:
                params.extra_args = {"kv_transfer_params": kvp}
        total = len(prompt) + params.max_tokens
        if total > self.config.max_model_len:
            raise EngineError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                              f"the model's context of {self.config.max_model_len} tokens")
        from vllm.inputs import TokensPrompt

        try:
            collector = await self.llm.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        except ValueError as exc:  # vLLM's own validation (e.g. token ids out of vocabulary)
            raise EngineError(str(exc)) from exc
        self._tracks[rid] = _Track(request, collector, path)

    def _consumer_params(self, handed: dict[str, Any] | None, landed: str | None) -> dict[str, Any] | None:
        """The decode request's kv_transfer_params: the prefill output's as they are (NIXL reads the blocks
        they name), ours pointed at the frame that landed here. None: compute the prompt here."""
        if not handed or not handed.get("do_remote_prefill"):
            return None
        # vLLM would report the prefill side's prefix hits as this request's cached tokens; the mesh reports
        # those itself (KvLanded.cached_tokens) and counts here what this engine did not compute.
        handed = {k: v for k, v in handed.items() if k != "remote_prefill_cached_tokens"}
        h = handed.get("hetmesh")
        if h is None:
            return handed if self.config.kv_connector == "nixl" else None
        if landed is None or self.config.kv_connector != "hetmesh":
            return None
        return {**handed, "hetmesh": {**h, "path": landed}}

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
                except Exception:  # the engine died or refused the request
                    log.exception("vllm request %s failed", request_id)
                    self._forget(t)
                    yield EngineOutput(request_id=request_id, index=t.index, token_ids=[], text="", finished=True,
                                       finish_reason="error", prompt_tokens=t.prompt_tokens,
                                       completion_tokens=t.index, cached_tokens=0)
                    return
                c = out.outputs[0] if out.outputs else None
                ids = list(c.token_ids) if c is not None else []
                lps = _logprobs(c, ids, req.sampling.logprobs) if c is not None else None
                text = c.text if c is not None else ""
                reason = c.finish_reason if c is not None else None
                cached = out.num_cached_tokens or 0
                index = t.index
                t.index += len(ids)
                self.tokens_generated += len(ids)
                finished = bool(out.finished)
                handover = None
                if finished and req.phase == Phase.PREFILL:
                    handover = self._handover(t, out.kv_transfer_params)
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

    def _handover(self, t: _Track, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """A finished PREFILL's kv_transfer_params for the decode side; ours gain the shards' sizes (the
        frame's layout), and `take_kv` then finds the shard files."""
        if not params or not params.get("do_remote_prefill"):
            return None
        h = params.get("hetmesh")
        if h is None:
            return params
        shards = [shard_path(h["path"], r) for r in range(int(h["tp_size"]))]
        try:
            sizes = [os.stat(p).st_size for p in shards]
        except OSError:
            log.warning("request %s: a KV shard of %s is missing", t.req.request_id, h["path"])
            return None
        self._prefill_kv[t.req.request_id] = shards
        return {**params, "hetmesh": {**h, "shard_bytes": sizes}}

    def _forget(self, t: _Track) -> None:
        rid = t.req.request_id
        if self._tracks.get(rid) is not t:
            return
        del self._tracks[rid]
        if t.req.phase == Phase.DECODE and t.kv_path:
            self._recycle_kv_file(t.kv_path)

    def _recycle_kv_file(self, path: str) -> None:
        """Keep a loaded KV file's pages for the next transfer to land in (at most FREE_KV_FILES of them,
        FREE_KV_BYTES in all: the biggest are kept, they fit the most)."""
        try:
            size = os.stat(path).st_size
            free = str(self.spool / f"free-{uuid.uuid4().hex[:12]}.kv")
            os.replace(path, free)
        except OSError:
            return
        self._free_kv.append((size, free))
        self._free_kv.sort(reverse=True)
        while len(self._free_kv) > FREE_KV_FILES or sum(n for n, _ in self._free_kv) > FREE_KV_BYTES:
            _, drop = self._free_kv.pop()
            with contextlib.suppress(OSError):
                os.unlink(drop)

    def _reuse_kv_file(self, nbytes: int) -> str | None:
        """The free KV file that fits nbytes most tightly, or the biggest one when none is big enough."""
        if not self._free_kv:
            return None
        fits = [i for i, (n, _) in enumerate(self._free_kv) if n >= nbytes]
        return self._free_kv.pop(fits[-1] if fits else 0)[1]

    def _account(self, t: _Track, cached: int, reason: str | None) -> None:
        if reason == "abort":
            self.aborted += 1
        prompt = t.prompt_tokens + t.first  # what the engine was given
        self.prompt_tokens_cached += min(cached, prompt)
        self.prompt_tokens_computed += max(0, prompt - cached)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._tracks or self.llm is None:
            return False
        await self.llm.abort(request_id)
        return True

    # ------------------------------------------------------------------ KV bytes for disaggregation
    def take_kv(self, request_id: str) -> bytes | memoryview | None:
        """The KV a finished PREFILL left (None with NIXL: the decode side reads it itself): every TP rank's
        shard file, back to back in rank order, the frame the hand-over's `shard_bytes` describe."""
        shards = self._prefill_kv.pop(request_id, None)
        if shards is None:
            return None
        try:
            return frame(shards)
        except FileNotFoundError:
            return None
        finally:
            for p in shards:
                with contextlib.suppress(OSError):
                    os.unlink(p)

    def put_kv(self, request_id: str, data: bytes | bytearray | memoryview) -> None:
        """KV bytes that landed for a DECODE: the consumer connector loads them when it is submitted."""
        path = self._kv_path(request_id)
        tmp = path + ".part"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self._pending_kv[request_id] = path

    def kv_sink(self, request_id: str, nbytes: int) -> _FileSink:
        """The landing file itself, mapped: the socket's bytes go straight into what the connector loads."""
        if nbytes <= 0:
            raise ValueError("an empty KV transfer")
        return _FileSink(self, request_id, self._kv_path(request_id), nbytes)

    # ------------------------------------------------------------------ stats and events
    def stats(self) -> EngineStats:
        s = self._stats
        total = self.kv_blocks_total
        return EngineStats(waiting=s.waiting, running=s.running, max_batch=self.config.max_batch,
                           kv_blocks_total=total, kv_blocks_used=round(s.kv_usage * total),
                           kv_blocks_cached=len(self._mapper.digests), block_size=self.config.block_size,
                           tokens_generated=self.tokens_generated, prompt_tokens_computed=self.prompt_tokens_computed,
                           prompt_tokens_cached=self.prompt_tokens_cached, aborted=self.aborted, steps=s.steps)

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
