"""Calibration recovers known efficiency factors from noisy samples; files round-trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetmesh.costmodel import CostModel, Efficiency, Sample, accelerator, calibrate, model_spec
from hetmesh.costmodel.calibrate import relative_errors, splitwise_samples
from hetmesh.costmodel.efficiency import load_efficiencies, save_efficiencies

DATA = Path(__file__).resolve().parents[1] / "data" / "splitwise_llama2-70b_a100_tp8.csv"  # rows of data/


def _shapes() -> list[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]]:
    shapes: list[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = []
    for n in (16, 128, 512, 2048, 8192):
        for b in (1, 4):
            shapes.append((((n, 0),) * b, ()))
    for b in (1, 2, 8, 32, 64, 128):
        for ctx in (256, 2048, 8192):
            shapes.append(((), (ctx,) * b))
    return shapes


@pytest.mark.parametrize("truth", [
    Efficiency(compute=0.4, memory=0.6, overhead_s=0.01, per_seq_s=2e-4),
    Efficiency(compute=0.7, memory=0.35, overhead_s=0.002, per_seq_s=5e-5),
])
def test_recovers_known_factors_from_noisy_samples(truth: Efficiency) -> None:
    rng = np.random.default_rng(7)
    acc, model = accelerator("nvidia-h100"), model_spec("llama-3.1-70b")
    gen = CostModel(acc, model, devices=4, efficiency=truth)
    samples = [Sample(p, d, gen.step_time(p, d) * float(rng.lognormal(0.0, 0.03))) for p, d in _shapes()]
    fit = calibrate(CostModel(acc, model, devices=4, efficiency=Efficiency()), samples, fit_per_seq=True)
    assert fit.compute == pytest.approx(truth.compute, rel=0.1)
    assert fit.memory == pytest.approx(truth.memory, rel=0.1)
    assert fit.overhead_s == pytest.approx(truth.overhead_s, rel=0.25, abs=5e-4)
    assert fit.per_seq_s == pytest.approx(truth.per_seq_s, rel=0.25, abs=2e-5)


def test_fixed_factors_stay_fixed() -> None:
    acc, model = accelerator("amd-mi300x"), model_spec("deepseek-r1")
    truth = Efficiency(compute=0.3, memory=0.5, overhead_s=0.02)
    gen = CostModel(acc, model, devices=8, efficiency=truth)
    samples = [Sample.prefill(4096, gen.prefill_time(4096)), Sample.decode(32, 2048, gen.decode_step_time(32, 65536))]
    fit = calibrate(CostModel(acc, model, devices=8), samples, fixed={"overhead_s": 0.02})
    assert fit.overhead_s == 0.02
    assert fit.compute == pytest.approx(0.3, rel=0.02) and fit.memory == pytest.approx(0.5, rel=0.02)


def test_fits_the_splitwise_measurements() -> None:
    samples = splitwise_samples(DATA, "llama2-70b", "a100-80gb", 8)
    cm = CostModel(accelerator("nvidia-a100-80g"), model_spec("llama-2-70b"), devices=8)
    fitted = CostModel(cm.accel, cm.model, devices=8, efficiency=calibrate(cm, samples, fit_per_seq=True))
    err = np.abs(relative_errors(fitted, samples))
    assert np.median(err) < 0.05 and np.percentile(err, 90) < 0.25


def test_efficiency_file_round_trip(tmp_path: Path) -> None:
    effs = {"amd-mi300x": Efficiency(compute=0.31, memory=0.52, overhead_s=0.012, per_seq_s=1e-4)}
    p = tmp_path / "eff.json"
    save_efficiencies(p, effs, note="test")
    assert load_efficiencies(p) == effs


def test_bad_samples_are_refused() -> None:
    cm = CostModel(accelerator("nvidia-h100"), model_spec("llama-3.1-8b"))
    with pytest.raises(ValueError):
        calibrate(cm, [])
    with pytest.raises(ValueError):
        calibrate(cm, [Sample.prefill(10, 0.0)])


def test_shipped_seed_factors_are_model_specific_and_match_a_fresh_calibration() -> None:
    from casestudy import calibrate_seed

    from hetmesh.costmodel.efficiency import default_efficiency

    fresh = calibrate_seed()
    for acc in ("amd-mi300x", "amd-mi308x"):
        shipped = default_efficiency(acc, "deepseek-r1")
        assert shipped.compute == pytest.approx(fresh[acc].compute, rel=0.01)
        assert shipped.memory == fresh[acc].memory and shipped.overhead_s == fresh[acc].overhead_s
        # what a cost model builds by default for that model on that chip; other models keep the chip's
        assert CostModel(accelerator(acc), model_spec("deepseek-r1"), devices=8).eff == shipped
        assert default_efficiency(acc, "llama-3.1-70b") == default_efficiency(acc)
