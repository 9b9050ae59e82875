"""Offline calibration: efficiency factors fitted to measured (shape, time) samples by least squares.

`calibrate` fits (compute, memory, overhead[, per_seq]) for one engine by minimising the relative
error of the step-time model over the samples; `server_model` builds one server's cost model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetmesh.costmodel.catalog import accelerator, model_spec
from hetmesh.costmodel.efficiency import Efficiency, lookup
from hetmesh.costmodel.model import CostModel
from hetmesh.protocol import StepSample


@dataclass(frozen=True)
class Sample:
    """One measured step (or a whole prefill / decode step): its batch shape and its seconds."""

    prefills: tuple[tuple[int, int], ...]  # (new, cached) per prefill chunk
    decode_contexts: tuple[int, ...]
    seconds: float

    @classmethod
    def prefill(cls, new: int, seconds: float, cached: int = 0) -> Sample:
        return cls(((new, cached),), (), seconds)

    @classmethod
    def decode(cls, batch: int, context: int, seconds: float) -> Sample:
        return cls((), (context,) * batch, seconds)

    @classmethod
    def of_step(cls, s: StepSample) -> Sample:
        """An engine's reported step (totals only) as equal prefill chunks and equal decode contexts."""
        pf = s.prefill_seqs
        prefills = tuple((_share(s.prefill_tokens, pf, i), _share(s.prefill_cached, pf, i)) for i in range(pf))
        ctx = tuple(max(1, _share(s.decode_context, s.n_decode, i)) for i in range(s.n_decode))
        return cls(prefills, ctx, s.seconds)


def _share(total: int, n: int, i: int) -> int:
    """The i-th of n near-equal integer parts of total."""
    return total // n + (1 if i < total % n else 0)


def server_model(accel_id: str, spec: str, *, devices: int = 1, parallel: str = "tp", dtype: str | None = None,
                 efficiencies: Mapping[str, Efficiency] | None = None) -> CostModel:
    """The cost model of one server: the one way the workers, the scheduler's policy and the simulator
    build it. `efficiencies` (a calibration's, or the cluster file's [costmodel] efficiency) is looked up
    by "<accelerator>/<model>", then "<accelerator>", then "default"; what it lacks comes from the shipped table."""
    ms = model_spec(spec)
    eff = lookup(efficiencies, accel_id, ms.name) if efficiencies else None
    return CostModel(accelerator(accel_id), ms, devices=devices, parallel=parallel, dtype=dtype, efficiency=eff)


def calibrate(cm: CostModel, samples: Sequence[Sample], fit_per_seq: bool = False,
              fixed: Mapping[str, float] | None = None) -> Efficiency:
    """Least-squares efficiency factors for `cm`'s engine from measured samples.

    `fixed` pins some factors (names of `Efficiency` fields) and fits the rest, e.g. when there
    are fewer samples than factors.
    """
    if not samples:
        raise ValueError("need at least one sample")
    feats = np.array([cm.step_features(s.prefills, s.decode_contexts) for s in samples], dtype=float)
    t = np.array([s.seconds for s in samples], dtype=float)
    if (t <= 0).any():
        raise ValueError("measured times must be > 0")
    fixed = dict(fixed or {})
    if not fit_per_seq:
        fixed.setdefault("per_seq_s", 0.0)
    names = ["compute", "memory", "overhead_s", "per_seq_s"]
    free = [n for n in names if n not in fixed]
    # fit inverse efficiencies (time multipliers): the model is linear in them inside the max
    to_x = {"compute": lambda e: 1.0 / e, "memory": lambda e: 1.0 / e, "overhead_s": lambda v: v,
            "per_seq_s": lambda v: v}
    lo = {"compute": 1 / 1.5, "memory": 1 / 1.5, "overhead_s": 0.0, "per_seq_s": 0.0}
    # up to 1e5x below peak: a CPU calibrated under a GPU's label (a GPU itself fits within a few x)
    hi = {"compute": 1e5, "memory": 1e5, "overhead_s": 10.0, "per_seq_s": 1.0}

    def unpack(x: np.ndarray) -> dict[str, float]:
        vals = {n: to_x[n](v) for n, v in fixed.items()}
        vals.update(dict(zip(free, x, strict=True)))
        return vals

    def resid(x: np.ndarray) -> np.ndarray:
        v = unpack(x)
        c, m = v["compute"], v["memory"]
        pred = (v["overhead_s"] + v["per_seq_s"] * feats[:, 7] + feats[:, 6]
                + np.maximum(feats[:, 0] * c, feats[:, 1] * m) + np.maximum(feats[:, 2] * c, feats[:, 3] * m)
                + np.maximum(feats[:, 4] * c, feats[:, 5] * m))
        return (pred - t) / t

    # Imported here: only a fit needs scipy, and its import slows the start of every service.
    from scipy.optimize import least_squares

    best = None
    starts = {"compute": (1.5, 3.0, 10.0, 1e3, 1e4), "memory": (1.2, 2.0, 5.0, 1e2), "overhead_s": (0.0, float(t.min()) / 2),
              "per_seq_s": (0.0, 1e-4)}
    grid = np.array(np.meshgrid(*[starts[n] for n in free])).T.reshape(-1, len(free)) if free else None
    if grid is None:
        return _efficiency(unpack(np.array([])))
    for x0 in grid:
        x0 = np.clip(x0, [lo[n] for n in free], [hi[n] for n in free])
        r = least_squares(resid, x0, bounds=([lo[n] for n in free], [hi[n] for n in free]), x_scale="jac")
        if best is None or r.cost < best.cost:
            best = r
    assert best is not None
    return _efficiency(unpack(best.x))


def _efficiency(v: Mapping[str, float]) -> Efficiency:
    return Efficiency(compute=1.0 / v["compute"], memory=1.0 / v["memory"],
                      overhead_s=float(v["overhead_s"]), per_seq_s=float(v["per_seq_s"]))


def relative_errors(cm: CostModel, samples: Sequence[Sample]) -> np.ndarray:
    return np.array([cm.step_time(s.prefills, s.decode_contexts) / s.seconds - 1.0 for s in samples])


def splitwise_samples(path: str | os.PathLike[str], model: str, hardware: str,
                      tensor_parallel: int) -> list[Sample]:
    """Samples from the Splitwise simulator's perf-model CSV (prompt_time: a batch of prompts;
    token_time: one decode step at the mean context of the generation)."""
    import csv

    out: list[Sample] = []
    with Path(path).open() as f:
        for r in csv.DictReader(f):
            if r["model"] != model or r["hardware"] != hardware or int(r["tensor_parallel"]) != tensor_parallel:
                continue
            p, b, n = int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"])
            out.append(Sample(((p, 0),) * b, (), float(r["prompt_time"]) / 1e3))
            out.append(Sample.decode(b, p + n // 2, float(r["token_time"]) / 1e3))
    return out
