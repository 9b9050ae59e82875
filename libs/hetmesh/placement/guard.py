"""The short decodes a worker holds and the TPOT slack each has left, so that a prefill is not placed where it
would push an admitted decode past its TPOT SLO.

The cost policy's prefill share prices a prefill beside a decode on average; a short decode instead lives
through the one or two prefills that land beside it. The policy guards the decodes one full prefill chunk
could break; a prefill placed on a worker takes its stolen seconds from the slack of every guarded decode
whose life it overlaps (`harmed` counts the output tokens a placement would push past their SLO). Plain
arrays, a row per worker slot; `now` passed in. Slack and the rule: docs/costmodel.md (The decode guard).
"""

from __future__ import annotations

import numpy as np

_COLS = 8  # decodes per row to start with; a full row doubles
_FIELDS = ("start", "end", "slack", "tokens")


class DecodeGuard:
    def __init__(self, slots: int = 16) -> None:
        self.start = np.zeros((slots, _COLS))
        self.end = np.full((slots, _COLS), -np.inf)  # -inf: a free cell
        self.slack = np.zeros((slots, _COLS))
        self.tokens = np.zeros((slots, _COLS))  # its output tokens: what goodput loses if it misses
        self.last_end = -np.inf  # no guarded decode lives past this (most placements find none alive)

    def _grow(self, rows: int, cols: int) -> None:
        for name in _FIELDS:
            a = getattr(self, name)
            fill = -np.inf if name == "end" else 0.0
            setattr(self, name, np.pad(a, ((0, rows), (0, cols)), constant_values=fill))

    def ensure(self, slots: int) -> None:
        """Room for `slots` rows."""
        n = self.end.shape[0]
        if slots > n:
            self._grow(max(slots - n, n), 0)

    def add(self, slot: int, start: float, end: float, tokens: int, slack: float, now: float) -> None:
        """Guard a decode of `tokens` output tokens placed on `slot`, predicted to run from `start` to `end`
        with `slack` seconds to spare (nothing to guard when it is predicted to miss anyway)."""
        if slack <= 0 or tokens < 2:
            return
        free = np.flatnonzero(self.end[slot] <= now)
        j = int(free[0]) if len(free) else self.end.shape[1]
        if not len(free):
            self._grow(0, self.end.shape[1])
        self.start[slot, j], self.end[slot, j], self.slack[slot, j], self.tokens[slot, j] = start, end, slack, tokens
        self.last_end = max(self.last_end, end)

    def harmed(self, slots: np.ndarray, at: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """Per slot: the output tokens of its decodes that a prefill starting there at `at` and taking `seconds`
        from them would push past their TPOT SLO (the ones alive then with less slack than that)."""
        if self.last_end <= at.min():
            return np.zeros(len(at))
        hit = ((self.end[slots] > at[:, None]) & (self.start[slots] < (at + seconds)[:, None])
               & (self.slack[slots] < seconds[:, None]))
        return np.where(hit, self.tokens[slots], 0.0).sum(axis=1)

    def charge(self, slot: int, at: float, seconds: float) -> None:
        """A prefill placed on `slot`, starting at `at` and taking `seconds` from the decodes beside it: each
        decode whose life it overlaps absorbs all of it (its steps run the chunks; a short decode lives on
        through them) and lives that much longer; one it pushes past its SLO is no longer guarded."""
        if self.last_end <= at:
            return
        end = self.end[slot]
        hit = (end > at) & (self.start[slot] < at + seconds)
        if hit.any():
            self.slack[slot, hit] -= seconds
            end[hit] += seconds
            self.last_end = max(self.last_end, float(end.max()))
            end[self.slack[slot] <= 0] = -np.inf
