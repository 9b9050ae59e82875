"""The seed case study reproduced: calibrate on the two single-server figures, predict the rest.

Prints the reproduction table and how the disaggregation ratio moves with the assumed workload
(prompt length, output length, clients per server); writes results/seed_case_study.json,
results/seed_efficiency.json and results/seed_case_study.png.
    .venv/bin/python benchmarks/seed_case_study.py
"""

from __future__ import annotations

from pathlib import Path

from casestudy import SEED_RATIO, Workload, reproduce, sweep
from rich.console import Console
from rich.table import Table

from hetmesh.costmodel import Efficiency, save_efficiencies
from hetmesh.sim.report import write_json

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = {"input_len": [1024, 2048, 3072, 4096, 6144, 8192], "output_len": [128, 192, 256, 384, 512, 1024],
          "clients_per_server": [2, 3, 4, 6, 8, 16]}


def main() -> int:
    console = Console(width=130)
    r = reproduce(Workload())
    t = Table(title=f"seed case study, DeepSeek-R1 FP8 (workload: {Workload()})")
    for c in ("configuration", "seed tok/s", "simulated tok/s", "error"):
        t.add_column(c, justify="right")
    labels = {"mi300x": "8x MI300X alone (calibration)", "mi308x": "8x MI308X alone (calibration)",
              "load_balanced": "3 servers, load balanced", "disaggregated": "prefill MI300X, decode 2x MI308X"}
    for k, label in labels.items():
        t.add_row(label, f"{r['seed'][k]:.2f}", f"{r['predicted'][k]:.2f}", f"{100 * r['error'][k]:+.1f}%")
    t.add_row("disaggregated / load balanced", f"{SEED_RATIO:.3f}", f"{r['ratio']:.3f}",
              f"{r['ratio'] - SEED_RATIO:+.3f}")
    console.print(t)
    eff = r["efficiency"]
    console.print(f"fitted compute efficiency: MI300X {eff['amd-mi300x']['compute']:.4f}, "
                  f"MI308X {eff['amd-mi308x']['compute']:.4f} (memory / overheads: Splitwise H100 prior)")
    sweeps = {}
    for param, values in SWEEPS.items():
        rows = sweep(param, values)
        sweeps[param] = rows
        st = Table(title=f"ratio vs {param} (others as assumed)")
        for c in (param, "load balanced", "disaggregated", "ratio", "ce MI300X", "ce MI308X"):
            st.add_column(c, justify="right")
        for row in rows:
            if "error" in row:
                st.add_row(str(row[param]), "-", "-", "unreachable", "-", "-")
                continue
            st.add_row(str(row[param]), f"{row['load_balanced']:.1f}", f"{row['disaggregated']:.1f}",
                       f"{row['ratio']:.3f}", f"{row['compute_eff_mi300x']:.4f}", f"{row['compute_eff_mi308x']:.4f}")
        console.print(st)
    out = ROOT / "results"
    write_json(out / "seed_case_study.json", {**r, "sweeps": sweeps})
    save_efficiencies(out / "seed_efficiency.json", {k: Efficiency(**v) for k, v in eff.items()},
                      note="DeepSeek-R1 FP8: compute fitted on the seed's single-server figures "
                           "(benchmarks/seed_case_study.py); memory and overheads: Splitwise H100 prior")
    try:
        _plot(out / "seed_case_study.png", sweeps)
    except Exception as e:  # plotting is a convenience; the numbers are in the JSON
        console.print(f"plot skipped: {e}")
    return 0


def _plot(path: Path, sweeps: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.2 * len(sweeps), 3.6), sharey=True)
    for ax, (param, rows) in zip(axes, sweeps.items(), strict=True):
        ok = [r for r in rows if "ratio" in r]
        ax.plot([r[param] for r in ok], [r["ratio"] for r in ok], marker="o", label="simulated")
        ax.axhline(SEED_RATIO, color="grey", ls="--", label="seed 1.53")
        ax.axvline(getattr(Workload(), param), color="red", alpha=0.3, label="assumed")
        ax.set_xlabel(param)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("disaggregated / load balanced")
    axes[0].legend(fontsize=8)
    fig.suptitle("seed case study: how the disaggregation gain moves with the workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
