"""Cluster files for the tests, built from a few arguments instead of TOML text written out in each test.

    CLUSTER = cluster_toml(mesh={"heartbeat_interval_s": 0.2}, models=[model("m", block_size=4)],
                           workers=[group("a", "m", "nvidia-h100", count=2)])

Tables and fields are the cluster file's own (hetmesh.config); nothing here adds a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w

from hetmesh import config


def model(name: str, **fields: Any) -> dict[str, Any]:
    """One `[[models]]` entry."""
    return {"name": name, **fields}


def group(name: str, model: str, accelerator: str, **fields: Any) -> dict[str, Any]:
    """One `[[workers]]` group (worker ids `<name>-<index>`)."""
    return {"name": name, "model": model, "accelerator": accelerator, **fields}


def cluster_toml(*, models: list[dict[str, Any]], workers: list[dict[str, Any]], extra: str = "",
                 **tables: dict[str, Any]) -> str:
    """A cluster file's text: the `tables` ([mesh], [scheduler], [gateway], ...), then `models` and `workers`,
    then `extra` (TOML text of more tables, e.g. `[auth]`)."""
    text = tomli_w.dumps({**tables, "models": models, "workers": workers})
    return f"{text}\n{extra}" if extra else text


def load_cluster(d: Path, text: str) -> config.ClusterConfig:
    """`text` written to `d`/cluster.toml and loaded as the services load it."""
    path = d / "cluster.toml"
    path.write_text(text)
    return config.load(path)
