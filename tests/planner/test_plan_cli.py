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
    got = capsys.readouterr()
    assert "per million good tokens" in got.out
    # one goodput: the layout table's title and the summary under it say the same figure
    title = next(line for line in got.out.splitlines() if "plan: the" in line)
    summary = next(line for line in got.out.splitlines() if line.startswith("goodput "))
    assert title.split("goodput ")[1].split()[0] == summary.split()[1]
    assert "requests refused (" in got.out  # this fleet refuses much of the trace, and says so
    # not a terminal: a line per simulation on stderr
    assert "planning: simulating the current layout on 50 requests" in got.err
    # the price basis, and the chip whose price is the catalog's estimate
    assert "prices: on-demand cloud rental, $ per device-hour" in got.out
    assert "runs on amd-mi308x: its price is assumed, not listed" in got.out
    out = tmp_path / "plan"
    cfg = config.load(out / "cluster.toml")
    seed = config.load(SEED)
    assert sum(g.count for g in cfg.workers) <= sum(g.count for g in seed.workers)
    assert {g.accelerator for g in cfg.workers} <= {g.accelerator for g in seed.workers}
    plan = json.loads((out / "plan.json").read_text())
    assert plan["chosen"] in {c["name"] for c in plan["candidates"]}
    assert all(c["what"] for c in plan["candidates"])  # every candidate says how it was found
    assert (out / "plan.png").stat().st_size > 0


@pytest.mark.slow
def test_catalog_plan_finds_the_cheapest_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--catalog", "--spec", "llama-3.1-70b", "--rate", "2", "--accelerators",
                 "nvidia-h200,amd-mi300x", "--max-servers", "4", "--out", str(tmp_path)]) == 0
    got = capsys.readouterr()
    res = json.loads((tmp_path / "buy" / "plan.json").read_text())
    assert res["cheapest"]["meets"] and res["cheapest"]["slo_attainment"] >= 0.9
    assert set(res["cheapest"]["servers"]) <= {"nvidia-h200", "amd-mi300x"}
    assert (tmp_path / "buy" / "pareto.png").stat().st_size > 0
    assert "{" not in got.out and "x nvidia-h200" in got.out + "x amd-mi300x"  # server mixes as text, not dicts
    assert "capacity planning: " in got.err
    assert "prices: on-demand cloud rental, $ per device-hour (the catalog's)" in got.out
    assert "its price is assumed" not in got.out  # both kinds have listed rental prices


def test_a_choice_on_an_assumed_price_says_so_and_a_price_given_is_not_assumed() -> None:
    from hetmesh.planner.report import price_lines

    lines = price_lines(["nvidia-h100", "intel-gaudi3"], "buys")
    assert lines[0] == "prices: on-demand cloud rental, $ per device-hour (the catalog's)"
    assert len(lines) == 2 and lines[1].startswith("buys intel-gaudi3: its price is assumed, not listed ($2.68")
    mine = price_lines(["nvidia-h100", "intel-gaudi3"], "buys", {"intel-gaudi3": 1.9})
    assert mine == ["prices: on-demand cloud rental, $ per device-hour (the catalog's), except intel-gaudi3: "
                    "the prices given"]


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
    (["--fleet", SEED, "--rate", "1", "--price", "amd-mi308x=cheap"], "want ACCELERATOR=USD"),
    (["--catalog", "--rate", "1", "--price", "nvidia-h999=2"], "unknown accelerator 'nvidia-h999'"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # the one line of the error, after any progress lines of what was simulated before it was found
    assert says in err[-1] and not any(line.startswith("hetmesh plan") for line in err[:-1])
