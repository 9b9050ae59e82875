"""`hetmesh calibrate`'s pure parts: pooling the scheduler's learned factors, the file it merges into, the grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetmesh.cli.calibrate import CalibrateError, grid, write
from hetmesh.costmodel.calibrate import Sample
from hetmesh.costmodel.efficiency import Efficiency, load_efficiencies
from hetmesh.costmodel.learn import pooled
from hetmesh.protocol import Role, StepSample, WorkerStatus


def _w(wid: str, steps: int, compute: float, accel: str = "nvidia-h100") -> WorkerStatus:
    return WorkerStatus(worker_id=wid, model="m", accelerator=accel, role=Role.BOTH, engine="sim", devices=1,
                        queue_depth=0, running=0, max_batch=8, kv_blocks_used=0, kv_blocks_total=0,
                        heartbeat_age_s=0.0, fitted_steps=steps, cost_model="tiny-llama",
                        efficiency={"compute": compute, "memory": 0.5, "overhead_s": 0.002, "per_seq_s": 0.0}
                        if steps else {})


def test_pooled_weights_time_multipliers_by_steps() -> None:
    out = pooled([_w("a", 100, 0.5), _w("b", 300, 0.25), _w("c", 0, 0.9), _w("d", 10, 0.4, "amd-mi300x")])
    assert set(out) == {"nvidia-h100/tiny-llama", "amd-mi300x/tiny-llama"}
    e, n, ws = out["nvidia-h100/tiny-llama"]
    assert n == 400 and ws == ["a", "b"]  # c has not reported: it keeps its prior and is left out
    assert 1 / e.compute == pytest.approx((100 * 2 + 300 * 4) / 400)
    assert e.memory == pytest.approx(0.5) and e.overhead_s == pytest.approx(0.002)


def test_write_merges_and_refuses_a_corrupt_file(tmp_path: Path) -> None:
    p = tmp_path / "eff.json"
    write(str(p), {"x/m": Efficiency(compute=0.3)}, {}, note="one")
    write(str(p), {"y/m": Efficiency(memory=0.2)}, {"y/m": {"samples": 7}}, note="two")
    effs = load_efficiencies(p)
    assert effs["x/m"].compute == 0.3 and effs["y/m"].memory == 0.2
    assert json.loads(p.read_text())["y/m"]["samples"] == 7
    p.write_text('{"z": {"compute": "fast"}}')
    with pytest.raises(CalibrateError, match="'compute'"):
        write(str(p), {"x/m": Efficiency()}, {}, note="")
    assert "fast" in p.read_text()  # not overwritten


def test_grid_fits_the_context() -> None:
    shapes = grid("small", 512)
    assert {s.kind for s in shapes} == {"prefill", "decode", "mixed"}
    assert all(s.length + 14 <= 512 for s in shapes)
    assert len(grid("full", 4096)) > len(shapes)


def test_a_step_as_a_sample() -> None:
    s = Sample.of_step(StepSample(10, 3, 0.0, 0, 5, 103, 0.1))
    assert s.prefills == ((4, 0), (3, 0), (3, 0)) and sum(s.decode_contexts) == 103 and len(s.decode_contexts) == 5
