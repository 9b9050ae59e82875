"""What a worker published on each response stream, kept so that a hole can be filled.

Token chunks travel on core NATS: a chunk published while the bus restarts, or while the gateway
was resubscribing, is gone. The gateway sees the hole (its reassembler waits for a missing
index, or the bus told it about a reconnect) and broadcasts `Resume(reply_subject, from_index)`;
every worker that published on that subject sends those chunks again, and the gateway's
reassembler drops what it already has. A worker whose own connection went down (its node of a NATS cluster
killed) may have lost chunks, a whole short stream even, that no gateway can miss: it sends its recent
streams again itself once reconnected (`recent`). Pure bookkeeping; the worker's shell publishes.
"""

from __future__ import annotations

from collections import OrderedDict


class ReplayLog:
    """Encoded TokenChunks per reply subject, oldest stream evicted first past either bound."""

    def __init__(self, max_bytes: int = 64 << 20, max_streams: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.max_streams = max_streams
        self.streams: OrderedDict[str, list[tuple[int, int, bytes]]] = OrderedDict()  # (index, tokens, data)
        self.touched: dict[str, float] = {}  # subject -> when a chunk was last added to it
        self.bytes = 0

    def add(self, subject: str, index: int, tokens: int, data: bytes, now: float = 0.0) -> None:
        chunks = self.streams.get(subject)
        if chunks is None:
            chunks = self.streams[subject] = []
        chunks.append((index, tokens, data))
        self.touched[subject] = now
        self.bytes += len(data)
        while self.streams and (self.bytes > self.max_bytes or len(self.streams) > self.max_streams):
            gone, old = self.streams.popitem(last=False)
            del self.touched[gone]
            self.bytes -= sum(len(d) for _, _, d in old)

    def recent(self, since: float) -> list[tuple[str, bytes]]:
        """Every chunk of the streams added to at or after `since`, with its subject, in order."""
        return [(subject, d) for subject, chunks in self.streams.items() if self.touched[subject] >= since
                for _, _, d in chunks]

    def __contains__(self, subject: str) -> bool:
        """Whether this worker has published a chunk on `subject` (and still keeps it)."""
        return subject in self.streams

    def since(self, subject: str, from_index: int) -> list[bytes]:
        """The chunks holding any token at or after `from_index`, and the finish marker if it is there."""
        return [d for i, n, d in self.streams.get(subject, ()) if i + n > from_index or i >= from_index]
