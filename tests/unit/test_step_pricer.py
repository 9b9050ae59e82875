"""The cost policy's step prices kept per worker between requests (pricing.StepPricer) are the very floats
`step_seconds_many` gives for the same steps, and its kept `Load` the numbers `pricing.load` works out whole,
whichever workers moved since (Fleet.take_moved)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from msgspec.structs import replace

from hetmesh.costmodel.model import step_seconds_many
from hetmesh.placement import RequestInfo, WorkerView, pricing
from hetmesh.placement.cost import CostPolicy
from hetmesh.protocol import Role

SHAPES = (("nvidia-h100", "tp"), ("amd-mi300x", "tp"), ("nvidia-h200", "dp"))


def _views(rng: random.Random, n: int) -> list[WorkerView]:
    out = []
    for i in range(n):
        acc, par = SHAPES[i % len(SHAPES)]
        out.append(WorkerView(worker_id=f"w{i}", model="m", accelerator=acc, vendor=acc.split("-")[0], devices=8,
                              role=(Role.BOTH, Role.PREFILL, Role.DECODE)[i % 3], queue_depth=rng.randint(0, 3),
                              running=rng.choice((0, 1, 5, 64)), max_batch=64, kv_blocks_total=50_000,
                              kv_blocks_used=rng.randint(0, 40_000), block_size=16, parallel=par,
                              step_tokens=rng.choice((512, 8192))))
    return out


def _reference(f: object, ld: pricing.Load, p: pricing.Prompt) -> dict[str, np.ndarray]:
    """Each step priced whole by step_seconds_many, as the pricer did before it kept anything."""
    z = np.zeros_like(ld.running)
    chunk = p.chunk

    def dec(batch: np.ndarray) -> np.ndarray:
        return step_seconds_many(f.coef, z, z, z, z, batch, batch * p.ctx)  # type: ignore[attr-defined]

    n, cached = p.first, p.cached
    pairs = n * cached + n * (n + 1) // 2
    copies = chunk / np.maximum(n, 1.0)
    return {"decode": dec(ld.seated), "decode_fewer": dec(ld.seated - 1), "decode_alone": dec(ld.running),
            "with_chunk": step_seconds_many(f.coef, chunk, z + 1.0, chunk * (chunk + 1) // 2, z,  # type: ignore[attr-defined]
                                            ld.running, ld.running * p.ctx),
            "first_chunk": step_seconds_many(f.coef, n, z + 1.0, pairs, cached,  # type: ignore[attr-defined]
                                             ld.running, ld.running * p.ctx),
            "packed": step_seconds_many(f.coef, n * copies, copies, pairs * copies,  # type: ignore[attr-defined]
                                        cached * copies, ld.running, ld.running * p.ctx) / copies}


@pytest.mark.parametrize("model", ["llama-3.1-70b", "deepseek-r1"])  # dense, and with experts
def test_kept_steps_are_the_floats_of_pricing_them_whole(model: str) -> None:
    rng = random.Random(5)
    pol = CostPolicy(models={"m": model}, learn=False)
    f, sp = pol._fleet, pricing.StepPricer()
    views = _views(rng, 40)
    for rnd in range(12):
        if rnd:  # a few workers move (bookings, heartbeats), or every one (rnd 6)
            for i in (range(len(views)) if rnd == 6 else rng.sample(range(len(views)), rng.choice((1, 3, 12)))):
                views[i] = replace(views[i], running=rng.choice((0, 1, 7, 64)), queue_depth=rng.randint(0, 9))
        f.sync(list(views))
        req = RequestInfo(request_id=f"r{rnd}", model="m", prompt_len=rng.randint(10, 9000),
                          max_tokens=rng.randint(1, 500), cached_blocks={"w1": rng.randint(0, 40)}, block_size=16)
        ld = sp.load(f)
        fresh = pricing.load(f)
        for name in pricing.Load.__struct_fields__:  # the kept load: the numbers worked out whole
            assert np.array_equal(getattr(ld, name), getattr(fresh, name)), (rnd, name)
        p = pricing.prompt(req, f, ld)
        got = sp(f, ld, p)
        for name, want in _reference(f, ld, p).items():
            assert np.array_equal(getattr(got, name), want), (rnd, name)


def test_a_fleet_says_which_rows_moved() -> None:
    rng = random.Random(1)
    f = CostPolicy(models={"m": "llama-3.1-70b"}, learn=False)._fleet
    views = _views(rng, 6)
    f.sync(views)
    assert f.take_moved() is None  # built: every row
    assert f.take_moved() == set()
    views = list(views)
    views[2] = replace(views[2], running=views[2].running + 1)
    views[4] = replace(views[4], queue_depth=views[4].queue_depth + 1)
    f.sync(views)
    assert f.take_moved() == {2, 4}
    f.sync([*views, _views(rng, 7)[6]])  # a worker joins: every row
    assert f.take_moved() is None


@pytest.mark.parametrize("flags", [0, 1, 3])
def test_first_k_is_the_head_of_lexsort(flags: int) -> None:
    """The options' order: pricing.first_k gives np.lexsort's first k, ties (many, and NaN) in index order."""
    rng = np.random.default_rng(flags)
    for rnd in range(300):
        n = int(rng.integers(1, 400))
        value = rng.integers(0, int(rng.choice((3, 50, 10_000))), n).astype(float)  # few distinct values: ties
        if rnd % 5 == 0:
            value[rng.random(n) < 0.3] = np.nan
        if rnd % 7 == 0:
            value[rng.random(n) < 0.3] = np.inf
        share = float(rng.choice((0.0, 0.1, 0.9, 1.0)))
        keys = tuple(rng.random(n) < share for _ in range(flags))
        for k in (1, 4, 16):
            want = np.lexsort((value, *keys))[:k]
            assert np.array_equal(pricing.first_k(value, keys, k), want), (rnd, k)
