"""Tensor parallelism and our KV connector: every TP rank saves and loads its own shard of the KV heads, the
shards travel as one frame, and prefill and decode may differ in TP where the heads split into whole slices.

The first tests drive the connector's own per-rank code (gather, frame, read, scatter) with two ranks' worth
of KV in plain tensors; the last ones run vLLM's CPU backend at tensor_parallel_size 2 for real (its two
worker processes share this machine's cores) against a TP 1 engine, both ways.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from hetmesh.engines.base import EngineError
from hetmesh.engines.vllm_connector import gather_blocks, read_shards, scatter_blocks
from hetmesh.engines.vllm_engine import VllmConfig, VllmEngine, frame
from hetmesh.engines.vllm_kv import shard_path, shard_sources, tp_pairing_problem
from hetmesh.protocol import Phase

from .conftest import BLOCK
from .test_engine import MODEL, _req, _run

HEADS = 4  # KV heads of the synthetic layers below
NUM_BLOCKS = 6


def test_tp_pairings_the_kv_layout_allows() -> None:
    assert tp_pairing_problem(8, 8, 1) is None  # equal sizes: every rank's heads stay where they were
    assert tp_pairing_problem(8, 4, 8) is None  # the production overlay's MI300X prefill -> n300 decode
    assert tp_pairing_problem(1, 2, 2) is None
    problem = tp_pairing_problem(4, 2, 2)  # TP 4 over 2 KV heads replicates them across ranks
    assert problem is not None and "use equal TP sizes" in problem
    assert tp_pairing_problem(3, 1, 4) is not None


def _layers(gen: torch.Generator) -> dict[str, torch.Tensor]:
    # The CPU backend's layout ([2, blocks, heads, block tokens, head size]); a layer of another width too.
    return {"layer.0": torch.randn(2, NUM_BLOCKS, HEADS, 4, 8, generator=gen),
            "layer.1": torch.randn(2, NUM_BLOCKS, HEADS, 4, 16, generator=gen)}


def _rank_view(full: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    per = HEADS // tp
    return {n: t[:, :, rank * per:(rank + 1) * per].clone() for n, t in full.items()}


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 2), (2, 1), (1, 2), (2, 4), (4, 1)])
def test_every_rank_saves_and_loads_its_own_shard(tmp_path: Path, src_tp: int, dst_tp: int) -> None:
    gen = torch.Generator().manual_seed(src_tp * 10 + dst_tp)
    full = _layers(gen)
    src_blocks, dst_blocks = [4, 1, 3], [0, 2, 5]
    dim = {n: 1 for n in full}
    # Prefill: each rank writes its shard (its heads of the request's blocks) where the shell finds it.
    path = str(tmp_path / "req.kv")
    for r in range(src_tp):
        Path(shard_path(path, r)).write_bytes(gather_blocks(_rank_view(full, r, src_tp), dim, src_blocks))
    shards = [shard_path(path, r) for r in range(src_tp)]
    sizes = [os.stat(p).st_size for p in shards]
    landed = tmp_path / "landed.kv"
    landed.write_bytes(bytes(frame(shards)))  # the one stream kv-transfer carries
    assert landed.stat().st_size == sum(sizes)
    # Decode: each rank takes its heads from the shard(s) that hold them; block 0 is a local prefix hit.
    for r in range(dst_tp):
        mine = {n: torch.zeros_like(t) for n, t in _rank_view(full, r, dst_tp).items()}
        sources = shard_sources(r, dst_tp, src_tp, HEADS)
        got = read_shards(str(landed), sizes, [s for s, _, _ in sources])
        scatter_blocks(mine, dim, got, sources, dst_blocks, first_block=1)
        want = _rank_view(full, r, dst_tp)
        for n, t in mine.items():
            assert torch.equal(t[:, dst_blocks[1:]], want[n][:, src_blocks[1:]]), (n, r)
            assert not t[:, dst_blocks[0]].any()  # the local hit is left alone
            rest = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
            assert not t[:, rest].any()


def test_mismatched_layouts_are_refused(tmp_path: Path) -> None:
    full = _layers(torch.Generator().manual_seed(0))
    path = str(tmp_path / "x.kv")
    Path(shard_path(path, 0)).write_bytes(gather_blocks(full, {n: 1 for n in full}, [0, 1]))
    size = os.stat(shard_path(path, 0)).st_size
    other = {n: torch.zeros(2, NUM_BLOCKS, HEADS, 4, 2 * t.shape[-1]) for n, t in full.items()}  # other head size
    with pytest.raises(RuntimeError, match="KV layouts differ"):
        scatter_blocks(other, {n: 1 for n in other}, read_shards(shard_path(path, 0), [size], [0]),
                       [(0, 0, HEADS)], [0, 1], 0)


async def test_a_pairing_the_layout_does_not_allow_is_refused_at_start(tiny_model: Path) -> None:
    # The tiny model has 2 KV heads: a TP 4 peer would hold replicated heads.
    e = VllmEngine(VllmConfig(model_dir=str(tiny_model), model_name=MODEL, block_size=BLOCK, peer_tp_sizes=[1, 4]))
    try:
        with pytest.raises(EngineError, match="TP 1 with a peer's TP 4"):
            await e.start()
        assert e.llm is None  # refused before loading anything
    finally:
        await e.close()


# ---------------------------------------------------------------------- vLLM at tensor_parallel_size 2
@pytest.fixture(scope="module")
async def tp_engines(tiny_model: Path) -> AsyncIterator[tuple[VllmEngine, VllmEngine]]:
    """`two`: TP 2 (two worker processes, one core each), `one`: TP 1."""
    def make(tp: int) -> VllmEngine:
        return VllmEngine(VllmConfig(model_dir=str(tiny_model), model_name=MODEL, block_size=BLOCK,
                                     max_model_len=1024, dtype="float32", kv_cache_gib=1, max_batch=8,
                                     tensor_parallel_size=tp, cpu_reserved_cores=0, peer_tp_sizes=[1, 2]))

    two, one = make(2), make(1)
    # vLLM's CPU workers bind their OpenMP threads per rank; on a small host name the cores for each rank.
    # The engine core reads it when it starts (spawned), so it applies to `two` only.
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}|{cores[-1]}"
    try:
        await two.start()
    finally:
        if bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    await one.start()
    try:
        yield two, one
    finally:
        await two.close()
        await one.close()


async def _pd(src: VllmEngine, dst: VllmEngine, rid: str, prompt: list[int], src_tp: int,
              perturb: bool = False) -> tuple[list[int], int]:
    first, pout = await _run(src, _req(f"{rid}-p", prompt, Phase.PREFILL))
    handover = pout.kv_transfer_params
    assert handover is not None and handover["hetmesh"]["tp_size"] == src_tp
    sizes = handover["hetmesh"]["shard_bytes"]
    assert len(sizes) == src_tp
    kv = src.take_kv(f"{rid}-p")
    assert kv is not None and len(kv) == sum(sizes)
    if perturb:  # noise in every shard, same sizes
        gen = torch.Generator().manual_seed(0)
        out, at = [], 0
        for n in sizes:
            tensors = st_load(bytes(kv[at:at + n]))
            at += n
            out.append(st_save({k: v if k.startswith("hetmesh.") else torch.randn(v.shape, generator=gen)
                                for k, v in tensors.items()}))
        handover = {**handover, "hetmesh": {**handover["hetmesh"], "shard_bytes": [len(b) for b in out]}}
        kv = b"".join(out)
    dst.put_kv(rid, kv)
    computed0 = dst.stats().prompt_tokens_computed
    rest, _ = await _run(dst, _req(rid, prompt, Phase.DECODE, first=first, handover=handover))
    return first + rest, dst.stats().prompt_tokens_computed - computed0


async def test_tp2_aggregated_and_disaggregated_both_ways_equal_vllm_alone(
        tp_engines: tuple[VllmEngine, VllmEngine], prompts: list[list[int]], reference: list[dict]) -> None:
    two, one = tp_engines
    p = prompts[0]
    ids, _ = await _run(two, _req("tp-agg", p))
    assert ids == reference[0]["token_ids"]
    # TP 2 -> TP 1: the decode rank joins both prefill shards' heads; TP 1 -> TP 2: each rank takes half.
    for rid, src, dst, tp, i in (("tp21", two, one, 2, 1), ("tp12", one, two, 1, 2)):
        ids, computed = await _pd(src, dst, rid, prompts[i], tp)
        assert ids == reference[i]["token_ids"], rid
        assert computed == 1, rid  # only the first token's position: the prompt was loaded


async def test_tp2_decode_output_depends_on_the_transferred_shards(
        tp_engines: tuple[VllmEngine, VllmEngine], prompts: list[list[int]]) -> None:
    two, one = tp_engines
    p = [3, *prompts[2]]  # shifted: nothing of it is in either prefix cache
    want, _ = await _run(two, _req("tp-noise-ref", p))  # on the prefill side: `one` must load all of it
    ids, computed = await _pd(two, one, "tp-noise", p, 2, perturb=True)
    assert computed == 1
    assert ids[0] == want[0] and ids[1:] != want[1:]
