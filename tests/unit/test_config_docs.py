"""docs/configuration.md is generated from libs/hetmesh/config.py (ops/config_docs.py) and must match it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec

from hetmesh import config

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("config_docs", ROOT / "ops" / "config_docs.py")
assert spec and spec.loader
config_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(config_docs)


def test_configuration_page_is_regenerated() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == config_docs.render(), "config schema changed: run .venv/bin/python ops/config_docs.py"


def test_every_section_and_field_is_on_the_page() -> None:
    page = config_docs.render()
    structs = {cls for _, cls in config_docs.sections()}
    assert config.MeshConfig in structs and config.VllmWorkerConfig in structs and config.ApiKey in structs
    for cls in structs:
        for f in msgspec.structs.fields(cls):
            assert f"| `{f.name}` |" in page, (cls.__name__, f.name)
    assert "## [workers.vllm]" in page and "## [[models]]" in page


def test_comments_beside_and_above_a_field_are_its_text() -> None:
    source = (
        "class A(Struct):\n"
        "    x: int = 1  # beside\n"
        "    # above, line one\n"
        "    # line two\n"
        "    y: str = ''\n"
        "\n"
        "    z: float = 0.0\n"
    )
    got = config_docs.field_comments(source)
    assert got[("A", "x")] == "beside"
    assert got[("A", "y")] == "above, line one line two"
    assert got[("A", "z")] == ""


def test_a_changed_default_shows_on_the_page(monkeypatch) -> None:
    class Mesh(msgspec.Struct, kw_only=True):
        time_scale: float = 7.5

    before = config_docs.render()
    monkeypatch.setattr(config, "MeshConfig", Mesh)
    monkeypatch.setattr(config, "ClusterConfig", msgspec.defstruct(
        "ClusterConfig", [("mesh", Mesh, msgspec.field(default_factory=Mesh))], kw_only=True))
    after = config_docs.render()
    assert after != before and "`7.5`" in next(line for line in after.splitlines() if "| `time_scale` |" in line)
