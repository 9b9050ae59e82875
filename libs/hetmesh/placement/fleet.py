"""The workers a policy sees, as arrays: one row per worker, refreshed from the `WorkerView`s by identity.

A view is immutable, so a worker whose view is the same object as last time has not changed; a
placement over hundreds of workers then rewrites only the few rows whose state moved since the
previous request (the simulator hands over the same objects for idle workers; the scheduler
rebuilds its views after a heartbeat or an assignment, which takes the full path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress
from operator import is_not

import numpy as np

from hetmesh.placement.state import WorkerView
from hetmesh.protocol import Role

BOTH, PREFILL, DECODE = 0, 1, 2
_ROLE = {Role.BOTH: BOTH, Role.PREFILL: PREFILL, Role.DECODE: DECODE}
# Columns of `num`.
NUMBERS = ("running", "queue_depth", "max_batch", "step_tokens", "kv_blocks_total", "kv_blocks_used", "block_size")


class Fleet:
    def __init__(self, row_of: Callable[[WorkerView], int], slot_of: Callable[[str], int],
                 table: Callable[[], np.ndarray]) -> None:
        self._row_of = row_of  # the cost-model row of a worker's server shape
        self._table = table  # cost-model rows -> coefficients (hetmesh.costmodel.model.COEFFICIENTS)
        self._slot_of = slot_of  # the policy's bookkeeping slot of a worker id
        self.views: list[WorkerView] = []
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.models: dict[str, int] = {}
        self.num = np.zeros((0, len(NUMBERS)))
        self.rows = np.zeros(0, dtype=np.intp)
        self.slots = np.zeros(0, dtype=np.intp)
        self.role = np.zeros(0, dtype=np.int8)
        self.model_code = np.zeros(0, dtype=np.intp)
        self.coef = np.zeros((0, 0))  # column i: worker i's cost-model coefficients
        self._coef2: np.ndarray | None = None

    def sync(self, workers: Sequence[WorkerView]) -> None:
        old = self.views
        if len(workers) == len(old):
            changed = list(compress(range(len(old)), map(is_not, workers, old)))  # C speed: most are the same
            if not changed:
                return
            ids = self.ids
            if len(changed) * 2 <= len(workers) and all(workers[i].worker_id == ids[i] for i in changed):
                for i in changed:
                    self._set(i, workers[i])  # reads self.views[i]: the old view
                self.views = list(workers)
                return
        self._rebuild(workers)

    def _set(self, i: int, w: WorkerView) -> None:
        self.num[i] = (w.running, w.queue_depth, w.max_batch, w.step_tokens, w.kv_blocks_total, w.kv_blocks_used,
                       w.block_size)
        old = self.views[i]
        if (w.accelerator, w.devices, w.parallel, w.model, w.role) != (old.accelerator, old.devices, old.parallel,
                                                                      old.model, old.role):
            self.rows[i] = self._row_of(w)  # a new server shape, model or role (rare: a re-plan)
            self.coef[:, i] = self._table()[self.rows[i]]
            self._coef2 = None
            self.role[i] = _ROLE[w.role]
            self.model_code[i] = self.models.setdefault(w.model, len(self.models))

    def _rebuild(self, workers: Sequence[WorkerView]) -> None:
        n = len(workers)
        self.views = list(workers)
        self.ids = [w.worker_id for w in workers]
        self.index = {wid: i for i, wid in enumerate(self.ids)}
        self.num = np.array([(w.running, w.queue_depth, w.max_batch, w.step_tokens, w.kv_blocks_total,
                              w.kv_blocks_used, w.block_size) for w in workers], dtype=float).reshape(n, len(NUMBERS))
        self.rows = np.array([self._row_of(w) for w in workers], dtype=np.intp)
        self.coef = np.ascontiguousarray(self._table()[self.rows].T)
        self._coef2 = None
        self.slots = np.array([self._slot_of(wid) for wid in self.ids], dtype=np.intp)
        self.role = np.array([_ROLE[w.role] for w in workers], dtype=np.int8)
        models = self.models
        self.model_code = np.array([models.setdefault(w.model, len(models)) for w in workers], dtype=np.intp)

    @property
    def coef2(self) -> np.ndarray:
        """`coef` twice side by side: two steps per worker priced in one call."""
        if self._coef2 is None:
            self._coef2 = np.concatenate([self.coef, self.coef], axis=1)
        return self._coef2
