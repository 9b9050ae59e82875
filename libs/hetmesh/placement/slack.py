"""The TPOT slack of the decodes a policy placed, per worker: what a prefill placed there would take from them.

In the batching core every step carries the decoding sequences plus prefill chunks, so a prefill of `pf`
seconds placed on a worker lengthens the steps of every sequence decoding there while it runs, by `pf` in all.
A decode of n tokens meets its TPOT SLO while its n - 1 steps sum to at most (n - 1) x the SLO: its slack is
(n - 1) x (SLO - its plain decode step) less the prefills that ran beside it. The ledger keeps, per worker, each
placed decode's predicted window, slack and output tokens; a prefill placed there takes `pf` from the slack of
the decodes its window overlaps (and pushes their end), and `harm` counts the output tokens of those it would
push from within the SLO to past it. Predictions only: the policy's own bookkeeping, like its prefill backlog.
"""

from __future__ import annotations

import numpy as np

_FIELDS = 4  # start, end, slack, tokens


class SlackLedger:
    def __init__(self) -> None:
        self._rows: dict[int, np.ndarray] = {}  # slot -> (k, 4) array of start, end, slack, tokens

    def _live(self, slot: int, now: float) -> np.ndarray | None:
        a = self._rows.get(slot)
        if a is None:
            return None
        if len(a) and a[:, 1].min() <= now:  # ended decodes leave
            a = self._rows[slot] = a[a[:, 1] > now]
        return a if len(a) else None

    def add(self, slot: int, start: float, end: float, slack: float, tokens: int) -> None:
        row = np.array([[start, end, slack, float(tokens)]])
        a = self._rows.get(slot)
        self._rows[slot] = row if a is None else np.vstack([a, row])

    def harm(self, slot: int, start: float, pf: float, stolen: float, now: float) -> float:
        """Output tokens of the decodes on `slot` that a prefill running [start, start + pf] and taking `stolen`
        seconds from the decodes beside it would push past their TPOT SLO (those within it with less slack)."""
        a = self._live(slot, now)
        if a is None:
            return 0.0
        hit = (a[:, 0] < start + pf) & (a[:, 1] > start) & (a[:, 2] >= 0.0) & (a[:, 2] < stolen)
        return float(a[hit, 3].sum())

    def stall(self, slot: int, start: float, pf: float, stolen: float, now: float) -> None:
        """A prefill placed on `slot` runs [start, start + pf]: the decodes it overlaps lose `stolen` of slack
        and end that much later."""
        a = self._live(slot, now)
        if a is None:
            return
        hit = (a[:, 0] < start + pf) & (a[:, 1] > start)
        a[hit, 1] += stolen
        a[hit, 2] -= stolen
