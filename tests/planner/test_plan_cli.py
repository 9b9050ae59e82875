"""`hetmesh plan`: a fleet plan writes a cluster file `hetmesh up` accepts; bad input is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetmesh import config
from hetmesh.cli.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
SEED = str(ROOT / "ops" / "clusters" / "seed-case-study.toml")
MOONCAKE = str(ROOT / "tests" / "data" / "mooncake_head50.jsonl")


def test_fleet_plan_writes_a_cluster_file_that_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--fleet", SEED, "--trace", MOONCAKE, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "per million good tokens" in out
    cfg = config.load(tmp_path / "cluster.toml")
    seed = config.load(SEED)
    assert sum(g.count for g in cfg.workers) <= sum(g.count for g in seed.workers)
    assert {g.accelerator for g in cfg.workers} <= {g.accelerator for g in seed.workers}
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["chosen"] in {c["name"] for c in plan["candidates"]}
    assert (tmp_path / "plan.png").stat().st_size > 0


@pytest.mark.slow
def test_catalog_plan_finds_the_cheapest_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--catalog", "--spec", "llama-3.1-70b", "--rate", "2", "--accelerators",
                 "nvidia-h200,amd-mi300x", "--max-servers", "4", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "plan.json").read_text())
    assert res["cheapest"]["meets"] and res["cheapest"]["slo_attainment"] >= 0.9
    assert set(res["cheapest"]["servers"]) <= {"nvidia-h200", "amd-mi300x"}
    assert (tmp_path / "pareto.png").stat().st_size > 0


@pytest.mark.parametrize(("args", "says"), [
    (["--catalog", "--accelerators", "nvidia-h999", "--rate", "1"], "unknown accelerator 'nvidia-h999'"),
    (["--catalog", "--spec", "no-such-model", "--rate", "1"], "unknown model spec 'no-such-model'"),
    (["--catalog", "--accelerators", "nvidia-h200", "--rate", "1", "--slo", "2,0.00001", "--max-servers", "2"],
     "relax the SLOs"),
    (["--catalog", "--rate", "1", "--slo", "fast"], "--slo 'fast'"),
    (["--catalog"], "give the demand"),
    (["--fleet", SEED, "--trace", "EMPTY"], "has no requests"),
    (["--fleet", SEED, "--trace", "/no/such/trace.jsonl"], "not found"),
    (["--fleet", SEED, "--rate", "1", "--model", "gpt-9"], "model 'gpt-9' is not in the cluster file"),
    (["--fleet", "/no/such.toml", "--rate", "1"], "cluster file"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
