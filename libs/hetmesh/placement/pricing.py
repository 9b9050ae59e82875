"""One request priced on every worker at once, in named steps: the cost policy's arithmetic over a `Fleet`'s arrays.

Each step is a pure function of the fleet's numbers and the request; the policy's own bookkeeping (each
worker's backlog, prefill share, decode slot life) is passed in. Every worker is priced in one numpy call
(`step_seconds_many`), so a placement over hundreds of workers stays well under a millisecond. What is
priced and why: docs/costmodel.md (cost-aware policy, a prefill worker's backlog).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec
import numpy as np

from hetmesh.costmodel.model import step_seconds_many
from hetmesh.placement.fleet import PREFILL, Fleet
from hetmesh.placement.state import RequestInfo


def pairs(n: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """Attention (query, key) pairs of n new tokens after `cached` ones, causal: n x cached + n(n + 1) // 2 (the
    floor of the half: exact in floats, and quicker than numpy's floor division)."""
    return n * cached + np.floor(n * (n + 1) * 0.5)


class Priced(msgspec.Struct, frozen=True, kw_only=True):
    """One request priced on every worker (arrays indexed like the fleet's workers)."""

    now: float
    pre: np.ndarray  # workers that can prefill it
    dec: np.ndarray  # workers that can decode it
    agg: np.ndarray  # the `both` ones among pre
    cached: np.ndarray  # prompt tokens each worker holds
    ctx: int  # the context a decode step is priced at
    prefill: np.ndarray  # prefill seconds on each worker (its steps, the decodes riding along included)
    booked: np.ndarray  # what it adds to the worker's backlog: `prefill`, or less where it shares steps
    stolen: np.ndarray  # of which the decodes there would not have spent anyway
    ttft: np.ndarray  # backlog + prefill on each worker as P, and its wait for a slot there (keeping SLOs)
    plain: np.ndarray  # decode step on each worker as D at its batch, no prefill beside it
    full_chunk: np.ndarray  # what one full prefill chunk there takes from the decodes beside it
    tpot: np.ndarray  # that step slowed by the worker's prefill share (as D where it also prefilled)
    joined: np.ndarray  # `tpot` for a decode joining after another worker's prefill: its slot wait spread in it
    prefill_delay: np.ndarray  # seconds a prefill there takes from the sequences running or queued there
    decode_delay: np.ndarray  # seconds this decode there adds to the others' steps
    fits: np.ndarray  # its KV fits on each worker as D


class Load(msgspec.Struct, frozen=True):
    """Each worker's numbers (`Fleet.num`'s columns) as pricing reads them, the batch a decode joins, and what
    follows from them alone (none depends on a request: `StepPricer.load` keeps them between requests)."""

    running: np.ndarray  # decodes running (0 on a prefill worker: its running sequences are prefills, booked)
    queue: np.ndarray
    max_batch: np.ndarray
    step_tokens: np.ndarray
    kv_total: np.ndarray
    kv_used: np.ndarray
    block_size: np.ndarray
    batch: np.ndarray  # running + queued + this one
    seated: np.ndarray  # of which in the batch at once (at most max_batch)
    fewer: np.ndarray  # seated - 1: the others beside it
    waits: np.ndarray  # the batch it joins is over full: it waits for a slot
    chunk: np.ndarray  # tokens a prefill step takes beside the running batch
    kv_free: np.ndarray  # KV blocks free
    kv_any: np.ndarray  # any request's KV fits: the worker reports no KV, or runs nothing
    per_block: np.ndarray  # tokens per KV block (at least 1)


def load(f: Fleet) -> Load:
    num = f.num.T.copy()  # a row per column: each contiguous
    running, queue, max_batch, step_tokens, kv_total, kv_used, block_size = num
    running[f.role == PREFILL] = 0.0
    batch = running + queue + 1
    seated = np.minimum(batch, max_batch)
    return Load(running, queue, max_batch, step_tokens, kv_total, kv_used, block_size, batch, seated, seated - 1,
                batch > max_batch, np.maximum(step_tokens - running, 1.0), kv_total - kv_used,
                (kv_total <= 0) | (running == 0), np.maximum(block_size, 1))


def _load_rows(ld: Load, f: Fleet, rows: Collection[int]) -> None:
    """`load` for a few workers, in place, in Python floats (the same IEEE arithmetic)."""
    for i in rows:
        running, queue, max_batch, step_tokens, kv_total, kv_used, block_size = f.num[i].tolist()
        if f.role[i] == PREFILL:
            running = 0.0
        batch = running + queue + 1
        ld.running[i], ld.queue[i], ld.max_batch[i], ld.step_tokens[i] = running, queue, max_batch, step_tokens
        ld.kv_total[i], ld.kv_used[i], ld.block_size[i], ld.batch[i] = kv_total, kv_used, block_size, batch
        ld.seated[i] = seated = min(batch, max_batch)
        ld.fewer[i], ld.waits[i], ld.chunk[i] = seated - 1, batch > max_batch, max(step_tokens - running, 1.0)
        ld.kv_free[i], ld.kv_any[i] = kv_total - kv_used, kv_total <= 0 or running == 0
        ld.per_block[i] = max(block_size, 1.0)


class Prompt(msgspec.Struct, frozen=True):
    """The request's prompt on each worker: what it holds of it and the chunks the rest is prefilled in."""

    cached: np.ndarray  # prompt tokens the worker holds (RequestInfo.cached_tokens)
    chunk: np.ndarray  # tokens a prefill step takes beside the running batch
    left: np.ndarray  # tokens to prefill (at least one)
    steps: np.ndarray  # prefill steps: left / chunk, rounded up
    first: np.ndarray  # the first step's tokens
    ctx: int  # the context a decode step is priced at: the prompt and half the output


def prompt(req: RequestInfo, f: Fleet, ld: Load) -> Prompt:
    length = req.prompt_len
    cached = np.zeros(len(f.ids))  # the few workers holding some of it, one by one
    most = max(length - 1, 0)
    for wid, nb in req.cached_blocks.items():
        i = f.index.get(wid)
        if i is not None:
            cached[i] = min(float(nb) * req.block_size, most)
    chunk = ld.chunk
    left = np.maximum(length - cached, 1.0)
    return Prompt(cached, chunk, left, np.ceil(left / chunk), np.minimum(left, chunk), length + req.max_tokens // 2)


class Steps(msgspec.Struct, frozen=True):
    """The steps priced per worker in one cost-model call (a block of the fleet's width each, in this order)."""

    first_chunk: np.ndarray  # the prompt's first chunk, the decode batch riding along
    decode: np.ndarray  # a decode step at the batch it joins (Load.seated)
    decode_fewer: np.ndarray  # at one fewer: the difference is this sequence's marginal cost
    decode_alone: np.ndarray  # the running batch alone: what a prefill's steps would have cost anyway
    with_chunk: np.ndarray  # a full chunk of a fresh prompt beside the running batch
    packed: np.ndarray | None  # its share of a step filled with copies of its first chunk (dp fleets only)


class StepPricer:
    """Prices `Steps`. Most of their terms do not depend on the request: the decode steps (at the batch it joins,
    at one fewer, the running batch alone) and a full chunk beside the batch depend on it only through their
    attention over its context, the first chunk through its tokens. What does not is kept per worker between
    requests (with the `Load`) and worked out again only for the workers whose numbers moved
    (`Fleet.take_moved`). The same floats as `step_seconds_many` (its terms, in its order)."""

    def __init__(self) -> None:
        self._ld: Load | None = None
        self._moved: set[int] | None = None  # rows the kept steps have still to work out again (None: all)
        # Per worker (columns), the four kept steps (rows): decode batch, the terms but attention, tokens over the
        # replicas, the prefill's attention pairs term (0 for the decodes), and whether the step is empty.
        self._batch = self._base = self._t = self._pf = np.zeros((4, 0))
        self._empty = np.zeros((4, 0), dtype=bool)
        # The first chunk's terms that do not depend on its tokens: the leading terms (overhead and per sequence)
        # and the dense sequences' term.
        self._lead = self._dense_s = np.zeros(0)

    def load(self, f: Fleet) -> Load:
        """The fleet's `Load`, worked out again only for the workers that moved since the last call."""
        moved = f.take_moved()
        ld = self._ld
        if moved is None or ld is None or len(ld.running) != len(f.ids) or len(moved) > 8:
            self._ld = ld = load(f)
        else:
            _load_rows(ld, f, moved)
        self._moved = None if moved is None or self._moved is None else self._moved | moved
        return ld

    def _keep(self, f: Fleet, ld: Load) -> None:
        moved, self._moved = self._moved, set()
        nw = len(f.ids)
        if moved is None or self._base.shape[1] != nw:
            rows: slice | np.ndarray = slice(None)
            self._batch, self._base, self._t, self._pf = (np.zeros((4, nw)) for _ in range(4))
            self._empty = np.zeros((4, nw), dtype=bool)
            self._lead, self._dense_s = np.zeros(nw), np.zeros(nw)
        elif not moved:
            return
        elif len(moved) <= 8 and not f.experts:
            self._keep_rows(f, ld, moved)
            return
        else:
            rows = np.fromiter(moved, dtype=np.intp, count=len(moved))
        c = f.coef[:, rows]
        inv_r, dense_c, dense_cs, dense_m, exp_c, log_miss, exp_m, attn_pf, _, _, comm, overhead, per_seq = c
        running, seated, fewer, chunk = ld.running[rows], ld.seated[rows], ld.fewer[rows], ld.chunk[rows]
        batch = np.stack((seated, fewer, running, running))
        tokens = np.stack((seated, fewer, running, chunk + running))
        seqs = np.stack((seated, fewer, running, 1.0 + running))
        t = tokens * inv_r
        base = overhead + per_seq * seqs + comm * t + np.maximum(dense_c * t + dense_cs * seqs, dense_m)
        if f.experts:
            base += np.maximum(exp_c * t, (1.0 - np.exp(log_miss * t)) * exp_m)
        self._batch[:, rows], self._base[:, rows], self._t[:, rows] = batch, base, t
        self._pf[3, rows] = attn_pf * (chunk * (chunk + 1) // 2)
        self._empty[:, rows] = tokens == 0
        self._lead[rows], self._dense_s[rows] = overhead + per_seq * seqs[3], dense_cs * seqs[3]

    def _keep_rows(self, f: Fleet, ld: Load, rows: set[int]) -> None:
        """`_keep` for a few workers, in Python floats: the same IEEE arithmetic in the same order, without the
        numpy calls' overhead (their expert term, an exp, is left to numpy)."""
        batch, base, t_, empty = self._batch, self._base, self._t, self._empty
        for i in rows:
            inv_r, dense_c, dense_cs, dense_m, _, _, _, attn_pf, _, _, comm, overhead, per_seq = f.coef[:, i].tolist()
            running, seated, chunk = float(ld.running[i]), float(ld.seated[i]), float(ld.chunk[i])
            for k, (b, tokens, seqs) in enumerate(((seated, seated, seated), (seated - 1, seated - 1, seated - 1),
                                                   (running, running, running),
                                                   (running, chunk + running, 1.0 + running))):
                t = tokens * inv_r
                batch[k, i], t_[k, i], empty[k, i] = b, t, tokens == 0
                base[k, i] = overhead + per_seq * seqs + comm * t + max(dense_c * t + dense_cs * seqs, dense_m)
            self._pf[3, i] = attn_pf * (chunk * (chunk + 1) // 2)
            self._lead[i], self._dense_s[i] = overhead + per_seq * (1.0 + running), dense_cs * (1.0 + running)

    def __call__(self, f: Fleet, ld: Load, p: Prompt) -> Steps:
        self._keep(f, ld)
        c = f.coef
        inv_r, attn_dec, attn_m = c[0], c[8], c[9]
        context = self._batch * p.ctx
        at_ctx = attn_dec * context
        kept = self._base + np.maximum(self._pf + at_ctx, (context * inv_r + self._t) * attn_m)
        np.putmask(kept, self._empty, 0.0)
        # The first chunk: n of the prompt's tokens (at least 1) beside the running batch, one sequence more.
        n, running = p.first, ld.running
        t = (n + running) * inv_r
        first = self._lead + c[10] * t + np.maximum(c[1] * t + self._dense_s, c[3])
        if f.experts:
            first += np.maximum(c[4] * t, (1.0 - np.exp(c[5] * t)) * c[6])
        first += np.maximum(c[7] * pairs(n, p.cached) + at_ctx[2], ((p.cached + context[2]) * inv_r + t) * attn_m)
        packed = None
        if f.packing:  # a data-parallel worker books a prompt at its packed share (`booking`)
            copies = p.chunk / np.maximum(n, 1.0)
            nc = n * copies
            packed = step_seconds_many(c, nc, copies, pairs(n, p.cached) * copies, p.cached * copies, running,
                                       context[2], f.experts) / copies
        return Steps(first, kept[0], kept[1], kept[2], kept[3], packed)


def prefill_time(f: Fleet, ld: Load, p: Prompt, s: Steps) -> tuple[np.ndarray, np.ndarray | None]:
    """Prefill seconds on each worker (the first chunk, then the rest of the prompt chunk by chunk, the
    decode batch riding along), and with a data-parallel worker in the fleet its packed share of them (both
    summed in place into `s.first_chunk` and `s.packed`)."""
    nw = len(f.ids)
    seconds = s.first_chunk
    packed = s.packed
    done = p.cached + p.first
    left = p.left - p.first
    coef = f.tiled(2) if packed is not None else f.coef
    running = ld.running
    while np.count_nonzero(left):  # a worker done with the prompt adds nothing
        n = np.minimum(left, p.chunk)
        on = (n > 0) * 1.0
        args = [n, on, pairs(n, done), done, running, running * p.ctx]
        if packed is not None:  # its last, partial chunk shares a step too
            k = p.chunk / np.maximum(n, 1.0)
            args = [np.concatenate([a, a * k]) for a in args[:4]] + [np.concatenate([a, a]) for a in args[4:]]
        t = step_seconds_many(coef, *args, experts=f.experts)
        seconds += t[:nw] * on
        if packed is not None:
            packed += t[nw:] / k * on
        done += n
        left -= n
    return seconds, packed


def booking(seconds: np.ndarray, packed: np.ndarray | None, backlog: np.ndarray, s: Steps,
            dp: np.ndarray) -> np.ndarray:
    """What a prefill adds to each worker's backlog. On a data-parallel worker its packed share as far as
    the backlog ahead of it fills its steps (a full step or more: full steps; none: a step of its own),
    since the batching core packs queued prompts' chunks under one token budget and a short prompt alone
    would book every engine's weight reads. Elsewhere its own steps: on tensor/expert-parallel workers a
    queued prompt waits for decode slots as much as for steps, and its own steps predict its TTFT."""
    if packed is None:
        return seconds
    fill = np.minimum(backlog / np.maximum(s.with_chunk, 1e-9), 1.0)
    return np.where(dp, seconds - (seconds - np.minimum(packed, seconds)) * fill, seconds)


class DecodeStep(msgspec.Struct, frozen=True):
    """A decode step on each worker as D, before the prefill share slows it."""

    plain: np.ndarray  # the decode step at the batch it joins; beyond max_batch, batch / max_batch of them
    marginal: np.ndarray  # what this sequence adds to that step (0 in a batch of one)
    full_chunk: np.ndarray  # what a full prefill chunk beside the running batch adds to its step
    waits: np.ndarray  # the batch it joins is over full: it waits for a slot


def decode_step(ld: Load, s: Steps) -> DecodeStep:
    step = s.decode
    waits = ld.waits
    if np.count_nonzero(waits):
        step = np.where(waits, step * (ld.batch / ld.max_batch), step)  # waits for a slot: b / max_batch rounds
    marginal = step - s.decode_fewer
    np.putmask(marginal, ld.fewer <= 0, 0.0)  # a batch of one
    return DecodeStep(step, marginal, s.with_chunk - s.decode_alone, waits)


def slot_wait(ld: Load, life: np.ndarray) -> np.ndarray | None:
    """Seconds a sequence joining each worker's batch waits for a slot: behind a full batch, batch - max_batch
    slots must free first, one every life / max_batch seconds (None where no batch is full)."""
    if not np.count_nonzero(ld.waits):
        return None
    return np.where(ld.waits, np.maximum(ld.batch - ld.max_batch, 0.0) * life / ld.max_batch, 0.0)


def tpot(d: DecodeStep, slow: np.ndarray) -> np.ndarray:
    """Time per output token on each worker as D: its step slowed by the prefill share (`slow` = 1 - share),
    never by more than a full chunk beside the batch."""
    return np.minimum(d.plain / slow, d.plain + d.full_chunk)


def joined(tpot: np.ndarray, wait: np.ndarray | None, n_out: int) -> np.ndarray:
    """`tpot` for a decode joining after another worker's prefill: the slot `wait` (when SLOs are kept) spread
    over its own tokens (with admission off the wait costs the cluster nothing: the rounds alone price it)."""
    return tpot if wait is None else tpot + wait / max(n_out - 1, 1)


def decode_delay(ld: Load, d: DecodeStep, slow: np.ndarray, n_out: int) -> np.ndarray:
    """Seconds a decode there adds to the other sequences' steps over its life."""
    return ld.fewer * max(n_out - 1, 0) * d.marginal / slow


def stalled(ld: Load, queued_prefills: np.ndarray) -> np.ndarray:
    """Sequences a prefill would hold up on each worker: its running batch and the decodes queued there
    (for their KV or a slot), not the prefills the policy queued ahead of it."""
    return ld.running + np.maximum(ld.queue - queued_prefills, 0.0)


def kv_fits(ld: Load, req: RequestInfo) -> np.ndarray:
    """The request's KV fits on each worker as D (or the worker reports no KV, or runs nothing)."""
    return ld.kv_any | (np.ceil((req.prompt_len + req.max_tokens) / ld.per_block) <= ld.kv_free)


def first_k(value: np.ndarray, flags: Sequence[np.ndarray], k: int) -> np.ndarray:
    """`np.lexsort((value, *flags))[:k]`: the k first by the flags (False first, the last flag the most
    significant), then by value, ties in index order. Where at least k have no flag set, only those within the
    k smallest values are sorted (a partition finds that bound), not all of them."""
    if len(value) > 2 * k:
        idx = None
        v = value
        if flags:
            bad = flags[0]
            for fl in flags[1:]:
                bad = bad | fl
            if bad.any():
                idx = (~bad).nonzero()[0]
                v = value[idx]
        if len(v) >= k:
            bound = np.partition(v, k - 1)[k - 1]
            if bound == bound:  # not NaN (NaNs sort last, and nothing is <= NaN)
                near = (v <= bound).nonzero()[0]
                if idx is not None:
                    near = idx[near]
                return near[value[near].argsort(kind="stable")[:k]]
    return np.lexsort((value, *flags))[:k]
