"""API keys and per-key rate limits: pure code, the gateway's shell calls it per request.

Keys are looked up by their SHA-256 (the config holds only digests). Limits are token buckets
of one minute's allowance refilled continuously: requests per minute are taken when a request
is admitted; tokens per minute are taken as they are known — the prompt at admission, the
completion when it ends — so a key may go into debt by one completion and then waits. (The
`limits` library's windows cannot charge after the fact, which tokens-per-minute needs.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetmesh.config import ApiKey, AuthConfig, hash_key
from hetmesh.protocol import ErrorInfo


@dataclass(slots=True)
class TokenBucket:
    per_minute: float
    level: float = math.nan  # nan: full (set on first use)
    t: float = 0.0

    def _refill(self, now: float) -> None:
        if math.isnan(self.level):
            self.level, self.t = self.per_minute, now
            return
        self.level = min(self.per_minute, self.level + (now - self.t) * self.per_minute / 60.0)
        self.t = now

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until `n` can be taken (0: now). More than a whole minute's allowance waits for a full bucket."""
        self._refill(now)
        need = min(n, self.per_minute) - self.level
        return 0.0 if need <= 0 else need * 60.0 / self.per_minute

    def take(self, n: float, now: float) -> None:
        self._refill(now)
        self.level -= n

    def remaining(self) -> int:
        return max(int(self.level), 0) if not math.isnan(self.level) else int(self.per_minute)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return 0.0 if math.isnan(self.level) else refill_s(self.per_minute, self.level)

    def follow(self, level: float, now: float) -> None:
        """Take on a shared bucket's level, seen at `now`; never above what this bucket holds itself, so a
        later fallback to this bucket is no more permissive than the shared one it last saw."""
        if math.isnan(self.level):
            self.level, self.t = level, now
            return
        self._refill(now)
        self.level = min(self.level, level)

    def start_empty(self, now: float) -> None:
        """A bucket that never saw its shared state starts empty, not full (a fallback must not grant a
        whole minute's allowance that the other replicas may have spent already)."""
        if math.isnan(self.level):
            self.level, self.t = 0.0, now


@dataclass(slots=True)
class KeyState:
    key: ApiKey
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    rate_limited: int = 0


@dataclass(slots=True)
class Verdict:
    key: KeyState | None = None  # who (None: auth is off)
    tenant: str = ""  # flow control's tenant ("" the default one)
    error: ErrorInfo | None = None
    headers: dict[str, str] = field(default_factory=dict)


def refill_s(per_minute: float, level: float) -> float:
    """Seconds a bucket of `per_minute` at `level` takes to be full again."""
    return max(per_minute - level, 0.0) * 60.0 / per_minute


def _bucket(limit: int) -> TokenBucket | None:
    return TokenBucket(float(limit)) if limit > 0 else None


MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
           "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")


def _redact(key: str) -> str:
    """A few leading characters of a wrong key, whatever its length (the 401 echoes no more than that)."""
    return key[:5] + "..." if len(key) > 8 else "***"


class Authenticator:
    def __init__(self, cfg: AuthConfig) -> None:
        self.enabled = bool(cfg.keys)
        self.keys: dict[str, KeyState] = {}
        for k in cfg.keys:
            self.keys[k.sha256.lower()] = KeyState(k, _bucket(k.rpm or cfg.default_rpm), _bucket(k.tpm or cfg.default_tpm))

    def authenticate(self, authorization: str | None) -> Verdict:
        """The key behind an `Authorization` header value, or the 401 to answer."""
        if not self.enabled:
            return Verdict()
        if not authorization:
            return Verdict(error=ErrorInfo(message=MISSING, type="invalid_request_error", status=401))
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return Verdict(error=ErrorInfo(message=MISSING, type="invalid_request_error", status=401))
        state = self.keys.get(hash_key(key))
        if state is None:
            return Verdict(error=ErrorInfo(message=f"Incorrect API key provided: {_redact(key)}.",
                                           type="invalid_request_error", code="invalid_api_key", status=401))
        return Verdict(key=state)

    @property
    def limited(self) -> bool:
        """Some key has a requests or tokens per minute limit."""
        return any(s.requests is not None or s.tokens is not None for s in self.keys.values())

    @staticmethod
    def admit(v: Verdict, prompt_tokens: int, now: float) -> Verdict:
        """Take one request and the prompt's tokens from the key's buckets in this process, or fill in the 429."""
        return decide(v, take_local(v.key, prompt_tokens, now) if v.key is not None else [])

    @staticmethod
    def charge_completion(v: Verdict, completion_tokens: int, now: float) -> None:
        if v.key is not None and v.key.tokens is not None and completion_tokens > 0:
            v.key.tokens.take(completion_tokens, now)


@dataclass(frozen=True, slots=True)
class Take:
    """One bucket's answer to an admission: seconds to wait (0: taken) and what is left after it."""

    kind: str  # "requests" | "tokens"
    limit: float  # per minute
    wait_s: float
    remaining: int
    reset_s: float = 0.0  # until the bucket is full again


def wants(s: KeyState, prompt_tokens: int) -> list[tuple[str, TokenBucket, int]]:
    """What an admission takes from each of the key's buckets: one request, the prompt's tokens."""
    return [(kind, b, n) for kind, b, n in (("requests", s.requests, 1), ("tokens", s.tokens, prompt_tokens))
            if b is not None]


def take_local(s: KeyState, prompt_tokens: int, now: float) -> list[Take]:
    """Admission against the key's buckets in this process: all of them or none."""
    ws = wants(s, prompt_tokens)
    waits = [b.wait_s(n, now) for _, b, n in ws]
    ok = max(waits, default=0.0) <= 0
    out = []
    for (kind, b, n), w in zip(ws, waits, strict=True):
        if ok:
            b.take(n, now)
        out.append(Take(kind, b.per_minute, w, b.remaining(), b.reset_s()))
    return out


def decide(v: Verdict, takes: list[Take]) -> Verdict:
    """The 429 (if any bucket makes the request wait) and the x-ratelimit headers (OpenAI's: limit, remaining,
    and reset, the time until the bucket is full again), from the buckets' answers."""
    s = v.key
    if s is None:
        return v
    worst = max(takes, key=lambda t: t.wait_s, default=None)
    if worst is not None and worst.wait_s > 0:
        s.rate_limited += 1
        unit = "RPM" if worst.kind == "requests" else "TPM"
        v.error = ErrorInfo(
            message=f"Rate limit reached for key {s.key.name!r} on {worst.kind} per min ({unit}): Limit "
                    f"{worst.limit:g}. Please try again in {worst.wait_s:.3g}s.",
            type=worst.kind, code="rate_limit_exceeded", status=429, retry_after_s=worst.wait_s)
    for t in takes:
        v.headers[f"x-ratelimit-limit-{t.kind}"] = str(int(t.limit))
        v.headers[f"x-ratelimit-remaining-{t.kind}"] = str(t.remaining)
        v.headers[f"x-ratelimit-reset-{t.kind}"] = duration(t.reset_s)
    return v


def duration(seconds: float) -> str:
    """A time as OpenAI's x-ratelimit-reset-* headers write it: 120ms, 8.64s, 6m0s."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(round(seconds * 1000), 1)}ms"
    minutes, s = divmod(round(seconds, 2), 60)
    text = f"{s:.2f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"


def retry_after_headers(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds (HTTP), and in ms (what the openai client reads first)."""
    return {"retry-after": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}
