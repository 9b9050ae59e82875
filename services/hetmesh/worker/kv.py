"""A worker's KV state as pure objects: what landed for its decodes, what its prefix cache holds, and
how a prefill's KV is to be shipped. No asyncio, NATS, sockets or clock reads (`now` comes in).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from hetmesh.engines.base import EngineOutput
from hetmesh.protocol import KvLanded, KvTransferRequest, Placement, WorkItem

STALE_S = 120.0  # KV that landed for a decode that never came is dropped after this long
KV_HEADER_ROOM = 1024  # bytes kept free in each relayed KV message for its headers (and the relay's)
RESYNC_BATCH = 20_000  # block hashes per KvEvent when republishing a whole cache (~400 KiB of JSON)

S = TypeVar("S")  # a KV sink (hetmesh.kvstream.KvSink); opaque here


@dataclass(slots=True)
class _Inbound(Generic[S]):
    nbytes: int = 0
    chunks: int = 0
    last_seen: float = 0.0
    sink: S | None = None  # the direct stream's: the bytes already sit in the engine's buffer
    kept: list[bytes] = field(default_factory=list)  # the relay's chunks, in order (engines with real KV)
    next_seq: int = 0


@dataclass(slots=True)
class Claim(Generic[S]):
    """What a decode finds of its transfer: a sink to commit, the relayed bytes, or a problem."""

    received: int  # bytes that arrived
    sink: S | None = None
    data: bytes | None = None
    problem: str | None = None  # the KV is unusable: prefill locally instead


class KvInbox(Generic[S]):
    """KV arriving at a decode worker, per transfer id, until its decode claims it. Relay chunks are
    counted (and, for engines with real KV, kept in sequence); a direct stream lands whole, in a sink."""

    def __init__(self, keep_bytes: bool, stale_s: float = STALE_S) -> None:
        self.keep_bytes = keep_bytes  # real KV (vLLM): the relayed bytes are the cache's content
        self.stale_s = stale_s
        self.bytes_received = 0  # every KV byte that reached this worker, for its metrics
        self._in: dict[str, _Inbound[S]] = {}

    def __len__(self) -> int:
        return len(self._in)

    def chunk(self, transfer_id: str, data: bytes, seq: int, now: float) -> None:
        """One relayed chunk (hetmesh.kv.recv.<worker>); one relay publishes a transfer in order."""
        e = self._in.get(transfer_id)
        if e is None:
            e = self._in[transfer_id] = _Inbound()
        e.nbytes += len(data)
        e.chunks += 1
        e.last_seen = now
        self.bytes_received += len(data)
        if self.keep_bytes and seq == e.next_seq:
            e.kept.append(data)
            e.next_seq += 1

    def streamed(self, transfer_id: str, nbytes: int, sink: S, now: float) -> None:
        """A direct stream landed whole in `sink`."""
        self._in[transfer_id] = _Inbound(nbytes=nbytes, chunks=1, last_seen=now, sink=sink)
        self.bytes_received += nbytes

    def bytes_seen(self, transfer_id: str) -> int:
        e = self._in.get(transfer_id)
        return e.nbytes if e is not None else 0

    def claim(self, landed: KvLanded) -> Claim[S]:
        """Take what arrived for `landed` (forgetting it here) and say whether the decode can use it."""
        e = self._in.pop(landed.transfer_id, None) if landed.transfer_id else None
        got = e.nbytes if e is not None else 0
        if landed.direct and e is not None and e.sink is not None:
            return Claim(got, sink=e.sink)
        if not (self.keep_bytes and landed.transfer_id) or landed.nbytes == 0:
            return Claim(got)  # simulated KV (only its size travelled), or the engine's connector moves it (NIXL)
        if e is None or got != landed.nbytes or e.next_seq != landed.chunks:
            return Claim(got, problem=f"KV arrived incomplete ({got} of {landed.nbytes} bytes)")
        return Claim(got, data=b"".join(e.kept))

    def sweep(self, now: float) -> list[S]:
        """Forget transfers nobody claimed; their sinks, for the caller to discard."""
        stale = [t for t, e in self._in.items() if now - e.last_seen > self.stale_s]
        return [s for s in (self._in.pop(t).sink for t in stale) if s is not None]

    def cancel(self, request_id: str) -> list[S]:
        """The request was cancelled: forget what landed for it; its sinks, for the caller to discard now."""
        gone = [t for t in self._in if request_of(t) == request_id]
        return [s for s in (self._in.pop(t).sink for t in gone) if s is not None]

    def drain(self) -> list[S]:
        """Forget everything (shutdown); the sinks to discard."""
        sinks = [e.sink for e in self._in.values() if e.sink is not None]
        self._in.clear()
        return sinks


class CacheMirror:
    """The block hashes the engine's prefix cache holds, from its KV event batches: what a resync
    republishes when the prefix index was lost."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def apply(self, stored: Iterable[int], removed: Iterable[int], cleared: bool) -> None:
        if cleared:
            self.held.clear()
        self.held.difference_update(removed)
        self.held.update(stored)

    def batches(self, size: int = RESYNC_BATCH) -> list[list[int]]:
        """The whole cache in KvEvent-sized pieces; one empty piece for an empty cache (it still clears)."""
        held = list(self.held)
        return [held[i:i + size] for i in range(0, max(len(held), 1), size)]


# ---------------------------------------------------------------------- shipping a prefill's KV
def transfer_id(request_id: str, nonce: str) -> str:
    """A transfer's id names its request (`request_of`), so a cancel finds what landed for it."""
    return f"{request_id}.{nonce}"


def request_of(transfer_id: str) -> str:
    return transfer_id.rpartition(".")[0]


def wire_bytes(kv_bytes_per_token: int, prompt_tokens: int, max_wire_bytes: int) -> int:
    """What a simulated engine puts on the wire: the real size, capped when the cluster says so."""
    n = kv_bytes_per_token * prompt_tokens
    return min(n, max_wire_bytes) if max_wire_bytes > 0 else n


def chunk_size(chunk_bytes: int, max_payload: int) -> int:
    # NATS refuses messages over the server's max_payload (1 MiB by default), headers included.
    return max(1, min(chunk_bytes, max_payload - KV_HEADER_ROOM))


def direct_endpoint(placement: Placement, data_plane: str) -> str:
    """The decode worker's KV port when the placement brought it and the cluster streams directly;
    empty: ask kv-transfer (an older scheduler, a decode worker without a port yet, the relay)."""
    return placement.decode_kv_endpoint if data_plane == "direct" else ""


def transfer_request(item: WorkItem, out: EngineOutput, src_worker: str, transfer_id: str, nbytes: int,
                     chunk_bytes: int, endpoint: str = "") -> KvTransferRequest:
    """The transfer of a finished prefill (`out` holds its first tokens) to the placement's decode worker."""
    req = item.request
    return KvTransferRequest(
        transfer_id=transfer_id, request_id=req.request_id, model=req.model, src_worker=src_worker,
        dst_worker=item.placement.decode_worker, num_tokens=len(req.prompt_tokens), nbytes=nbytes,
        chunk_bytes=chunk_bytes, first_token_ids=out.token_ids, first_text=out.text,
        cached_tokens=out.cached_tokens, endpoint=endpoint, kv_transfer_params=out.kv_transfer_params)
