from pathlib import Path

import pytest

from hetmesh import config, subjects

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_cluster_files_load() -> None:
    for p in (ROOT / "ops" / "clusters").glob("*.toml"):
        cfg = config.load(p)
        assert cfg.models and cfg.workers, p


def test_seed_case_cluster_shape() -> None:
    cfg = config.load(ROOT / "ops/clusters/seed-case-study.toml")
    by = {g.accelerator: g for g in cfg.workers}
    assert by["amd-mi300x"].count == 1 and by["amd-mi300x"].devices == 8
    assert by["amd-mi308x"].count == 2 and by["amd-mi308x"].devices == 8


def test_unknown_field_and_unknown_model_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text('[mesh]\nnats = "x"\n')
    with pytest.raises(Exception, match="nats"):
        config.load(bad)
    bad.write_text('[[models]]\nname="a"\n[[workers]]\nname="w"\nmodel="b"\naccelerator="amd-mi300x"\n')
    with pytest.raises(KeyError, match="b"):
        config.load(bad)


def test_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMESH_NATS_URL", "nats://10.0.0.1:1")
    monkeypatch.setenv("HETMESH_POLICY", "round_robin")
    cfg = config.load()
    assert cfg.mesh.nats_url == "nats://10.0.0.1:1" and cfg.scheduler.policy == "round_robin"


def test_work_subjects_encode_vendor_and_accelerator() -> None:
    assert subjects.work_direct("prefill", "amd", "amd-mi300x", "mi300x-0") == "hetmesh.work.prefill.amd.amd-mi300x.mi300x-0"
    assert subjects.reply("a.b c") == "hetmesh.resp.a_b_c"


def test_readme_subject_table_is_the_code_table() -> None:
    assert subjects.markdown_table() in (ROOT / "README.md").read_text()
