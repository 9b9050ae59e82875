"""Flow control in the simulator: tenants on trace requests, the flow queue where the scheduler holds, per-tenant
results."""

from __future__ import annotations

from hetmesh.placement.flow import Tenant
from hetmesh.sim import SimConfig, Slo, pool, simulate, synthetic
from hetmesh.sim.traces import merge, with_tenants

WORKERS = pool("h100", 2, "nvidia-h100", model="llama-3.1-8b", devices=1, max_batch=32)
SLO = Slo(2.0, 0.1)


def _quiet_and_noisy() -> tuple:
    quiet = with_tenants(synthetic(200, 4, input_mean=512, output_mean=64, seed=1), {"quiet": 1})
    noisy = with_tenants(synthetic(1200, 24, input_mean=8192, output_mean=64, seed=2), {"noisy": 1})
    return quiet, merge(quiet, noisy)


def test_a_flooding_tenant_does_not_take_the_quiet_ones_share() -> None:
    quiet, both = _quiet_and_noisy()
    tenants = (Tenant("quiet"), Tenant("noisy"))
    alone, _ = simulate(WORKERS, "cost", quiet, SimConfig(tenants=tenants), SLO)
    fair, _ = simulate(WORKERS, "cost", both, SimConfig(tenants=tenants), SLO)
    unfair, _ = simulate(WORKERS, "cost", both, SimConfig(), SLO)
    q_alone = alone["tenants"]["quiet"]["offered_slo_attainment"]
    q_fair = fair["tenants"]["quiet"]["offered_slo_attainment"]
    assert q_fair >= q_alone - 0.05, (q_alone, q_fair)
    assert q_fair >= unfair["tenants"]["quiet"]["offered_slo_attainment"] - 0.01
    assert fair["tenants"]["noisy"]["rejected"] > 0  # the flood is turned away, not the quiet tenant


def test_without_tenants_the_run_is_unchanged() -> None:
    tr = synthetic(150, 6, input_mean=512, output_mean=64, seed=3)
    a, _ = simulate(WORKERS, "cost", tr, SimConfig(), SLO)
    b, _ = simulate(WORKERS, "cost", with_tenants(tr, {"x": 1}), SimConfig(), SLO)
    assert a["goodput_tok_s"] == b["goodput_tok_s"] and "tenants" in b and "tenants" not in a
