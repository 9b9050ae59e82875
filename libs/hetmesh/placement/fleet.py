"""The workers a policy sees, as arrays: one row per worker, refreshed from the `WorkerView`s by identity.

A view is immutable, so a worker whose view is the same object as last time has not changed; a
placement over hundreds of workers then rewrites only the few rows whose state moved since the
previous request (the simulator hands over the same objects for idle workers; the scheduler
rebuilds its views after a heartbeat or an assignment, which takes the full path).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from itertools import compress
from operator import attrgetter, is_not

import numpy as np

from hetmesh.costmodel.model import has_experts
from hetmesh.placement.state import WorkerView
from hetmesh.protocol import Role

BOTH, PREFILL, DECODE = 0, 1, 2
_ROLE = {Role.BOTH: BOTH, Role.PREFILL: PREFILL, Role.DECODE: DECODE}
# Columns of `num`.
NUMBERS = ("running", "queue_depth", "max_batch", "step_tokens", "kv_blocks_total", "kv_blocks_used", "block_size")
_numbers = attrgetter(*NUMBERS)


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
        self.dp = np.zeros(0, dtype=bool)  # data-parallel: an engine per device
        self.model_code = np.zeros(0, dtype=np.intp)
        self.coef = np.zeros((0, 0))  # column i: worker i's cost-model coefficients
        # Derived from the rows, roles and models (rebuilt when one moves): coef side by side k times, the
        # pools per model, rows as a list, and `slots` as a slice when it is 0..n-1 (a view, not a gather).
        self._tiles: dict[int, np.ndarray] = {}
        self._pools: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.row_list: list[int] = []
        self.slot_index: slice | np.ndarray = slice(0, 0)
        self.experts = False  # a worker's model has experts (pricing leaves their term out otherwise)
        self.packing = False  # a worker is data-parallel (pricing prices a prompt's packed share)
        self._moved: set[int] | None = None  # rows whose numbers moved since `take_moved` (None: every row)

    def sync(self, workers: Sequence[WorkerView]) -> None:
        old = self.views
        if len(workers) == len(old):
            changed = _changed(workers if isinstance(workers, list) else list(workers), old)
            if not changed:
                return
            ids = self.ids
            if all(workers[i].worker_id == ids[i] for i in changed):
                for i in changed:
                    self._set(i, workers[i])  # reads self.views[i]: the old view
                if self._moved is not None:
                    self._moved.update(changed)
                self.views = list(workers)
                return
        self._rebuild(workers)

    def _set(self, i: int, w: WorkerView) -> None:
        old = self.views[i]
        num = self.num
        for j, (new, was) in enumerate(zip(_numbers(w), _numbers(old), strict=True)):  # the row equals old's numbers
            if new != was:
                num[i, j] = new  # only the few that moved: a whole row from a tuple costs several times more
        if (w.accelerator, w.devices, w.parallel, w.model, w.role) != (old.accelerator, old.devices, old.parallel,
                                                                      old.model, old.role):
            self.rows[i] = self._row_of(w)  # a new server shape, model or role (rare: a re-plan)
            self.coef[:, i] = self._table()[self.rows[i]]
            self.role[i] = _ROLE[w.role]
            self.dp[i] = w.parallel == "dp"
            self.model_code[i] = self.models.setdefault(w.model, len(self.models))
            self._derive()

    def recost(self, worker_id: str) -> None:
        """A worker's cost-model row changed (its learned speed): reread its row and coefficients."""
        i = self.index.get(worker_id)
        if i is None:
            return
        self.rows[i] = self._row_of(self.views[i])
        self.coef[:, i] = self._table()[self.rows[i]]
        self._derive()

    def _rebuild(self, workers: Sequence[WorkerView]) -> None:
        n = len(workers)
        self.views = list(workers)
        self.ids = [w.worker_id for w in workers]
        self.index = {wid: i for i, wid in enumerate(self.ids)}
        self.num = np.array([_numbers(w) for w in workers], dtype=float).reshape(n, len(NUMBERS))
        self.rows = np.array([self._row_of(w) for w in workers], dtype=np.intp)
        self.coef = np.ascontiguousarray(self._table()[self.rows].T)
        self.slots = np.array([self._slot_of(wid) for wid in self.ids], dtype=np.intp)
        self.role = np.array([_ROLE[w.role] for w in workers], dtype=np.int8)
        self.dp = np.array([w.parallel == "dp" for w in workers], dtype=bool)
        models = self.models
        self.model_code = np.array([models.setdefault(w.model, len(models)) for w in workers], dtype=np.intp)
        self._derive()

    def take_moved(self) -> set[int] | None:
        """The rows whose numbers, shape or role moved since the last call (None: every row, or the fleet changed)."""
        moved, self._moved = self._moved, set()
        return moved

    def _derive(self) -> None:
        self._moved = None
        self._tiles = {}
        self._pools = {}
        self.row_list = self.rows.tolist()
        n = len(self.slots)
        self.slot_index = slice(0, n) if np.array_equal(self.slots, np.arange(n)) else self.slots
        self.experts = has_experts(self.coef) if self.coef.size else False
        self.packing = bool(self.dp.any())

    def tiled(self, k: int) -> np.ndarray:
        """`coef` k times side by side: k steps per worker priced in one call."""
        t = self._tiles.get(k)
        if t is None:
            t = self._tiles[k] = np.concatenate([self.coef] * k, axis=1)
        return t

    @property
    def coef2(self) -> np.ndarray:
        return self.tiled(2)

    def pools(self, model: str, exclude: Collection[str] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Indices of the workers serving `model`, not excluded, that can prefill, that can decode, and the
        `both` ones among the first (kept per model while the fleet's shape stands)."""
        got = None if exclude else self._pools.get(model)
        if got is None:
            mask = self.model_code == self.models.get(model, -1)
            for wid in exclude:
                i = self.index.get(wid)
                if i is not None:
                    mask[i] = False
            role = self.role
            pre = np.flatnonzero(mask & (role != DECODE))
            got = (pre, np.flatnonzero(mask & (role != PREFILL)), pre[role[pre] == BOTH])
            if not exclude:
                self._pools[model] = got
        return got


def _changed(new: list[WorkerView], old: list[WorkerView], block: int = 64) -> list[int]:
    """Where `new` holds another view than `old` (most are the same objects): a block of them compared as lists
    first (C speed: same objects are equal at once; one equal by value may pass), then the differing blocks one
    by one."""
    out: list[int] = []
    for lo in range(0, len(old), block):
        hi = lo + block
        a, b = new[lo:hi], old[lo:hi]
        if a != b:
            out.extend(compress(range(lo, lo + len(a)), map(is_not, a, b)))
    return out
