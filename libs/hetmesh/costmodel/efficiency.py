"""Efficiency factors: how far below the roofline one engine runs, and the JSON file that stores them.

`efficiency.json` beside this module ships one `Efficiency` per accelerator id ("default" for the ones
nobody measured); "<accelerator>/<model>" keys win over the accelerator's own. A calibration
(`hetmesh calibrate`, `hetmesh.costmodel.calibrate`) or the online fit writes files of the same shape.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from functools import cache
from pathlib import Path

_SHIPPED = Path(__file__).resolve().parent / "efficiency.json"
FIELDS = ("compute", "memory", "overhead_s", "per_seq_s")


@dataclass(frozen=True)
class Efficiency:
    compute: float = 0.5  # fraction of peak FLOP/s reached by the kernels
    memory: float = 0.7  # fraction of peak memory bandwidth
    overhead_s: float = 0.004  # fixed per step: scheduling, kernel launches, sampling
    per_seq_s: float = 0.0  # per sequence in the batch per step (sampling, bookkeeping)

    def __post_init__(self) -> None:
        if not all(math.isfinite(getattr(self, f)) for f in FIELDS):
            raise ValueError(f"efficiency factors must be finite: {self}")
        if not (0 < self.compute <= 1.5 and 0 < self.memory <= 1.5):
            raise ValueError(f"efficiency factors must be in (0, 1.5]: {self}")
        if self.overhead_s < 0 or self.per_seq_s < 0:
            raise ValueError(f"overheads must be >= 0: {self}")


class EfficiencyFileError(ValueError):
    """A malformed efficiency file: the message names the file and the entry or field."""


def load_efficiencies(path: str | os.PathLike[str]) -> dict[str, Efficiency]:
    """The entries of an efficiency file; keys starting with "_" are notes. Unknown fields are errors."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise EfficiencyFileError(f"{p}: cannot read an efficiency file: {e}") from None
    if not isinstance(raw, dict):
        raise EfficiencyFileError(f"{p}: expected a JSON object of accelerator -> factors")
    names = {f.name for f in fields(Efficiency)}
    out: dict[str, Efficiency] = {}
    for key, d in raw.items():
        if key.startswith("_"):
            continue
        if not isinstance(d, dict):
            raise EfficiencyFileError(f"{p}: entry {key!r} is not an object of factors")
        unknown = sorted(set(d) - names - {"_note", "std", "samples"})
        if unknown:
            raise EfficiencyFileError(f"{p}: entry {key!r}: unknown field(s) {unknown}; known: {sorted(names)}")
        vals = {f: d[f] for f in names if f in d}
        for f, v in vals.items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise EfficiencyFileError(f"{p}: entry {key!r} field {f!r}: expected a number, got {v!r}")
        try:
            out[key] = Efficiency(**vals)
        except ValueError as e:
            raise EfficiencyFileError(f"{p}: entry {key!r}: {e}") from None
    return out


def save_efficiencies(path: str | os.PathLike[str], effs: Mapping[str, Efficiency], note: str = "",
                      extra: Mapping[str, Mapping[str, object]] | None = None) -> None:
    """Write `effs` (and per-entry `extra` fields such as a fit's std and sample count)."""
    out: dict[str, object] = {"_note": note} if note else {}
    for k, e in sorted(effs.items()):
        out[k] = {**asdict(e), **dict((extra or {}).get(k, {}))}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")


@cache
def _shipped() -> dict[str, Efficiency]:
    return load_efficiencies(_SHIPPED)


def lookup(table: Mapping[str, Efficiency], accel_id: str, model: str | None = None) -> Efficiency | None:
    """"<accelerator>/<model>", then "<accelerator>", then "default"."""
    return ((table.get(f"{accel_id}/{model}") if model else None) or table.get(accel_id) or table.get("default"))


def default_efficiency(accel_id: str, model: str | None = None) -> Efficiency:
    """The shipped factors for an accelerator (and model, where a fit for that pair ships)."""
    return lookup(_shipped(), accel_id, model) or Efficiency()
