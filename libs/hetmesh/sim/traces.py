"""Request traces for the simulator: Mooncake JSONL, Azure CSV, and synthetic generators.

A trace is a list of `TraceRequest` in arrival order (open loop), or a `ClosedLoop` source that
issues a new request whenever one of its fixed number of clients gets its answer.
`hash_ids` name the prompt's prefix blocks of `block_tokens` tokens (Mooncake: 512): equal ids
at equal positions mean a shared prefix, which is what the simulated prefix caches key on.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK = 512
# The public traces kept in the source tree (data/README.md: each file's source and licence).
DATA_DIR = Path(__file__).resolve().parents[3] / "data"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # seconds since the trace start
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    model: str = ""  # which model it asks for; "" in a one-model trace
    tenant: str = ""  # flow control's tenant; "" the default one


@dataclass
class Trace:
    requests: list[TraceRequest]
    block_tokens: int = MOONCAKE_BLOCK
    name: str = "trace"

    def __len__(self) -> int:
        return len(self.requests)

    def scaled(self, rate_factor: float) -> Trace:
        """The same requests arriving `rate_factor` times faster (load sweeps)."""
        return Trace([TraceRequest(r.arrival / rate_factor, r.input_len, r.output_len, r.hash_ids, r.model, r.tenant)
                      for r in self.requests], self.block_tokens, f"{self.name}x{rate_factor:g}")

    def head(self, n: int) -> Trace:
        return Trace(self.requests[:n], self.block_tokens, self.name)


@dataclass
class ClosedLoop:
    """`concurrency` clients, each sending its next request as soon as the last one finished."""

    concurrency: int
    total: int
    input_len: int | Sequence[int] = 1024
    output_len: int | Sequence[int] = 256
    block_tokens: int = MOONCAKE_BLOCK
    seed: int = 0
    shared_prefix_tokens: int = 0  # every request starts with this common prefix (a system prompt)
    name: str = "closed-loop"
    _rng: np.random.Generator = field(init=False, repr=False)
    _issued: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def _draw(self, v: int | Sequence[int]) -> int:
        return int(v) if isinstance(v, int) else int(v[int(self._rng.integers(len(v)))])

    def next(self, now: float) -> TraceRequest | None:
        if self._issued >= self.total:
            return None
        i = self._issued
        self._issued += 1
        n_in = self._draw(self.input_len)
        shared = min(self.shared_prefix_tokens, n_in) // self.block_tokens
        own = n_in // self.block_tokens - shared
        hashes = tuple(range(shared)) + tuple(10**9 + i * 10**4 + j for j in range(max(own, 0)))
        return TraceRequest(now, n_in, max(self._draw(self.output_len), 1), hashes)


def load_mooncake(path: str | os.PathLike[str], limit: int | None = None) -> Trace:
    out: list[TraceRequest] = []
    with Path(path).open() as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            out.append(TraceRequest(float(d["timestamp"]) / 1e3, int(d["input_length"]),
                                    max(int(d["output_length"]), 1), tuple(d.get("hash_ids") or ())))
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival)
    return Trace(out, MOONCAKE_BLOCK, Path(path).stem)


def load_azure(path: str | os.PathLike[str], limit: int | None = None) -> Trace:
    """Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens); no prefix info."""
    out: list[TraceRequest] = []
    t0: datetime | None = None
    with Path(path).open() as f:
        for row in csv.DictReader(f):
            ts = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
            t0 = t0 or ts
            out.append(TraceRequest((ts - t0).total_seconds(), max(int(row["ContextTokens"]), 1),
                                    max(int(row["GeneratedTokens"]), 1)))
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival)
    return Trace(out, MOONCAKE_BLOCK, Path(path).stem)


def load(path: str | os.PathLike[str], limit: int | None = None) -> Trace:
    p = str(path)
    return load_azure(p, limit) if p.endswith(".csv") else load_mooncake(p, limit)


def _lengths(rng: np.random.Generator, n: int, mean: int, dist: str, lo: int = 1) -> np.ndarray:
    if dist == "fixed":
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        return rng.integers(max(lo, mean // 2), mean * 3 // 2 + 1, n)
    if dist == "lognormal":  # heavy right tail, like real prompt lengths; sigma 0.8
        s = 0.8
        return np.maximum(lo, rng.lognormal(np.log(mean) - s * s / 2, s, n).astype(np.int64))
    if dist == "exponential":
        return np.maximum(lo, rng.exponential(mean, n).astype(np.int64))
    raise ValueError(f"unknown length distribution {dist!r}")


def synthetic(
    n: int,
    rate: float,
    input_mean: int = 1024,
    output_mean: int = 256,
    input_dist: str = "lognormal",
    output_dist: str = "lognormal",
    arrival: str = "poisson",
    burst_factor: float = 4.0,
    burst_period_s: float = 60.0,
    prefix_groups: int = 0,
    prefix_tokens: int = 0,
    block_tokens: int = MOONCAKE_BLOCK,
    seed: int = 0,
) -> Trace:
    """Open-loop synthetic trace.

    arrival: "poisson" (rate req/s), "bursty" (Poisson whose rate alternates every half period
    between a high and a low one, `burst_factor` apart, averaging `rate`), or "uniform".
    prefix_groups > 0: each request belongs to one of that many groups (Zipf-ish popularity)
    whose first `prefix_tokens` tokens are shared (agent system prompts, multi-turn history).
    """
    rng = np.random.default_rng(seed)
    if arrival == "poisson":
        times = np.cumsum(rng.exponential(1.0 / rate, n))
    elif arrival == "uniform":
        times = np.arange(n) / rate
    elif arrival == "bursty":
        hi, lo = rate * 2 * burst_factor / (1 + burst_factor), rate * 2 / (1 + burst_factor)
        t, out = 0.0, []
        for _ in range(n):
            r = hi if (t % burst_period_s) < burst_period_s / 2 else lo
            t += float(rng.exponential(1.0 / r))
            out.append(t)
        times = np.array(out)
    else:
        raise ValueError(f"unknown arrival process {arrival!r}")
    ins = _lengths(rng, n, input_mean, input_dist)
    outs = _lengths(rng, n, output_mean, output_dist)
    groups = None
    if prefix_groups > 0:
        w = 1.0 / np.arange(1, prefix_groups + 1)
        groups = rng.choice(prefix_groups, n, p=w / w.sum())
    reqs: list[TraceRequest] = []
    shared_blocks = prefix_tokens // block_tokens
    for i in range(n):
        n_in = int(ins[i])
        blocks = n_in // block_tokens
        hashes: list[int] = []
        if groups is not None:
            k = min(shared_blocks, blocks)
            hashes = [int(groups[i]) * 10**6 + j for j in range(k)]
        hashes += [10**9 + i * 10**4 + j for j in range(blocks - len(hashes))]
        reqs.append(TraceRequest(float(times[i]), n_in, int(outs[i]), tuple(hashes)))
    return Trace(reqs, block_tokens, f"synthetic-{arrival}")


def with_tenants(trace: Trace, shares: dict[str, float], seed: int = 0) -> Trace:
    """The same requests, each given a tenant drawn with probability proportional to its share."""
    names = list(shares)
    p = np.array([shares[n] for n in names], dtype=float)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(names), len(trace.requests), p=p / p.sum())
    return Trace([replace(r, tenant=names[int(i)]) for r, i in zip(trace.requests, picks, strict=True)],
                 trace.block_tokens, trace.name)


def merge(*traces: Trace) -> Trace:
    """Several open-loop traces as one, in arrival order (their block sizes must agree)."""
    if len({t.block_tokens for t in traces}) > 1:
        raise ValueError("traces to merge must hash blocks of the same size")
    reqs = sorted((r for t in traces for r in t.requests), key=lambda r: r.arrival)
    return Trace(reqs, traces[0].block_tokens, "+".join(t.name for t in traces))


def iter_open(trace: Trace) -> Iterator[TraceRequest]:
    return iter(trace.requests)
