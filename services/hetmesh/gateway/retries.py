"""A client's retries of a request the mesh refused: how long it has waited since its first try.

The official openai client retries a 429 or 503 by itself (twice by default, after Retry-After) and says so in
`x-stainless-retry-count`. To its user the tries are one request, whose first token is late by every try before
it; SLO-aware admission must judge a retry by that whole wait, or it serves requests far past their SLO while it
refuses others. The gateway remembers, for a while, when each refused request (the key and the body) was first
sent, and hands the wait since to the scheduler with the retry (InferenceRequest.waited_s). Per gateway: a retry
that a load balancer sends to another replica starts afresh there.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

RETRY_HEADER = "x-stainless-retry-count"
KEEP_S = 180.0  # three times the longest Retry-After (a minute): the client's retries come within it
MAX_KEPT = 10_000  # the oldest are forgotten past this many


def is_retry(headers: object) -> bool:
    """The client says this is a retry of a request it sent before."""
    n = headers.get(RETRY_HEADER)  # type: ignore[attr-defined]
    return bool(n) and n != "0"


def fingerprint(authorization: str, body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=16, key=authorization.encode()[:64]).digest()


class Refused:
    """When each recently refused request was first sent (monotonic seconds), by fingerprint."""

    def __init__(self, keep_s: float = KEEP_S, max_kept: int = MAX_KEPT) -> None:
        self.keep_s = keep_s
        self.max_kept = max_kept
        self._first: OrderedDict[bytes, float] = OrderedDict()

    def waited_s(self, fp: bytes, now: float) -> float:
        """How long the request has waited since its first send (0: not refused here before)."""
        first = self._first.get(fp)
        return 0.0 if first is None or now - first > self.keep_s else now - first

    def remember(self, fp: bytes, first_sent: float, now: float) -> None:
        self._first.pop(fp, None)
        self._first[fp] = first_sent
        while self._first and (len(self._first) > self.max_kept
                               or now - next(iter(self._first.values())) > self.keep_s):
            self._first.popitem(last=False)
