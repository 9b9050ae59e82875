"""`placement.aggregated`: a P/D decision turned into one worker's, for requests whose engine state
cannot cross the hand-over (structured-output grammars)."""

from __future__ import annotations

from hetmesh.placement import Decision, RequestInfo, WorkerView, aggregated
from hetmesh.protocol import Role


def view(wid: str, role: Role, running: int = 0, model: str = "m") -> WorkerView:
    return WorkerView(worker_id=wid, model=model, accelerator="nvidia-h100", vendor="nvidia", devices=1, role=role,
                      queue_depth=0, running=running, max_batch=8, kv_blocks_total=100, kv_blocks_used=0,
                      block_size=16)


REQ = RequestInfo(request_id="r", model="m", prompt_len=64, max_tokens=8, cached_blocks={"p": 2, "b1": 1})
PD = Decision(mode="disaggregated", prefill_worker="p", decode_worker="d", reason="cost")


def test_the_chosen_worker_that_serves_both_roles_keeps_it() -> None:
    got = aggregated(PD, REQ, [view("p", Role.BOTH), view("d", Role.BOTH)])
    assert got is not None and got.mode == "aggregated" and got.prefill_worker is None
    assert got.decode_worker == "d"
    got = aggregated(PD, REQ, [view("p", Role.BOTH), view("d", Role.DECODE)])
    assert got is not None and got.decode_worker == "p" and got.expected_cached_tokens == 32


def test_else_the_least_utilised_both_worker_of_the_model_or_none() -> None:
    views = [view("p", Role.PREFILL), view("d", Role.DECODE), view("b0", Role.BOTH, running=5),
             view("b1", Role.BOTH, running=1), view("x", Role.BOTH, model="other")]
    got = aggregated(PD, REQ, views)
    assert got is not None and got.decode_worker == "b1" and got.expected_cached_tokens == 16
    assert aggregated(PD, REQ, views[:2]) is None
    agg = Decision(mode="aggregated", decode_worker="d")
    assert aggregated(agg, REQ, views) is agg
