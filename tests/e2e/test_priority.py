"""vLLM's request priority (`priority`, lower first) through the real gateway, scheduler and a sim-engine
worker with one batch slot: two requests queued behind a running one are served in priority order, and in
arrival order when their priorities are equal (the batching core's queue, as vLLM's priority scheduling)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from hetmesh.launcher import Mesh

from ..clusters import cluster_toml, group, model
from .conftest import running_mesh

CLUSTER = cluster_toml(
    mesh={"time_scale": 0.5, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0},
    scheduler={"policy": "least_loaded"},
    models=[model("one-slot", spec="tiny-llama", max_context=4096, block_size=16)],
    workers=[group("h100", "one-slot", "nvidia-h100", role="both", max_batch=1)])


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(tmp_path_factory.mktemp("one-slot"), CLUSTER) as m:
        yield m


async def _served_order(client: openai.AsyncOpenAI, priorities: dict[str, int]) -> list[str]:
    """A long request takes the slot (~4 s here); then the others arrive in the dict's order, 0.3 s apart, and queue."""
    done: list[str] = []

    async def one(name: str, priority: int, max_tokens: int) -> None:
        await client.completions.create(model="one-slot", prompt=f"request {name}", max_tokens=max_tokens,
                                        extra_body={"ignore_eos": True, "priority": priority})
        done.append(name)

    stream = await client.completions.create(model="one-slot", prompt="the long one", max_tokens=120, stream=True,
                                             extra_body={"ignore_eos": True})
    first = await anext(aiter(stream))  # it runs: the slot is taken
    assert first.choices
    tasks = []
    for name, priority in priorities.items():
        tasks.append(asyncio.create_task(one(name, priority, 4)))
        await asyncio.sleep(0.3)
    async for _ in stream:
        pass
    await asyncio.gather(*tasks)
    return done


async def test_queued_requests_are_served_by_priority_then_arrival(one_slot: Mesh) -> None:
    async with openai.AsyncOpenAI(base_url=one_slot.url + "/v1", api_key="none", max_retries=0) as client:
        assert await _served_order(client, {"late-low": 5, "later-high": -5}) == ["later-high", "late-low"]
        assert await _served_order(client, {"first": 0, "second": 0}) == ["first", "second"]


async def test_a_priority_that_is_not_an_integer_is_refused(one_slot: Mesh) -> None:
    async with openai.AsyncOpenAI(base_url=one_slot.url + "/v1", api_key="none", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model="one-slot", prompt="x", max_tokens=2, extra_body={"priority": "high"})
        assert exc.value.body["param"] == "priority"  # type: ignore[index]
