"""Who is moving, for a model, and when to retry (hetmesh.placement.state.moving / back_in_s): the
scheduler's 503 `model_moving` while a model's workers switch role or model."""

from __future__ import annotations

from hetmesh.placement.state import back_in_s, moving
from hetmesh.protocol import Heartbeat, Role


def hb(wid: str, model: str, moving_to: str = "", moving_model: str = "", ready_in_s: float = 0.0) -> Heartbeat:
    return Heartbeat(worker_id=wid, model=model, accelerator="nvidia-h100", vendor="nvidia", devices=1,
                     role=Role.BOTH, engine="sim", work_subject="", queue_depth=0, running=0, max_batch=8,
                     kv_blocks_total=10, kv_blocks_used=0, block_size=16, ts=0.0, draining=bool(moving_to),
                     moving_to=moving_to, moving_model=moving_model, ready_in_s=ready_in_s)


def test_moving_workers_of_a_model_and_those_coming_to_it() -> None:
    beats = [hb("a0", "a"), hb("a1", "a", "both", "b", 30.0), hb("b0", "b", "prefill", "", 4.0),
             hb("c0", "c", "both", "a", 12.0), hb("d0", "d", "both", "b", 1.0)]
    assert [h.worker_id for h in moving("a", beats)] == ["a1", "c0"]  # leaving a, coming to a
    assert [h.worker_id for h in moving("b", beats)] == ["a1", "b0", "d0"]
    assert moving("e", beats) == []


def test_retry_after_is_the_soonest_worker_back_within_floor_and_cap() -> None:
    leaving = [hb("a1", "a", "both", "b", 30.0)]
    assert back_in_s("a", leaving, 1.0) == 1.0  # nobody comes back to a: the configured floor
    assert back_in_s("b", leaving, 1.0) == 30.0  # a1 brings b back in about 30 s
    assert back_in_s("b", [*leaving, hb("b0", "b", "prefill", "", 4.0)], 1.0) == 4.0  # the soonest
    assert back_in_s("b", [hb("b0", "b", "prefill", "", 0.2)], 1.0) == 1.0  # never below the floor
    assert back_in_s("b", [hb("x", "a", "both", "b", 900.0)], 1.0) == 60.0  # nor past the cap
