"""The decode guard (hetmesh.placement.guard) by hand, and the cost policy sparing a fragile decode."""

import numpy as np

from hetmesh.placement import RequestInfo, WorkerView, make_policy
from hetmesh.placement.guard import DecodeGuard
from hetmesh.protocol import Role


def _harmed(g: DecodeGuard, at: float, seconds: float) -> float:
    return float(g.harmed(np.array([0]), np.array([at]), np.array([seconds]))[0])


def test_a_prefill_harms_the_decodes_alive_beside_it_with_less_slack_than_it_takes() -> None:
    g = DecodeGuard(slots=2)
    g.add(0, start=1.0, end=2.0, tokens=10, slack=0.3, now=0.0)
    g.add(0, start=1.0, end=9.0, tokens=400, slack=5.0, now=0.0)
    g.add(0, start=1.0, end=2.0, tokens=7, slack=-0.1, now=0.0)  # predicted to miss anyway: not guarded
    assert _harmed(g, 1.5, 0.4) == 10  # the short one only: 0.4 s > its 0.3 s, < the long one's 5 s
    assert _harmed(g, 1.5, 0.2) == 0
    assert _harmed(g, 2.5, 0.4) == 0  # the short one ended by then
    assert _harmed(g, 0.5, 0.4) == 0  # over before the short one starts (0.5 + 0.4 < 1.0)
    assert _harmed(g, 0.5, 6.0) == 410  # a long prefill overlapping both
    g.charge(0, 1.5, 0.2)  # absorbed by both: slack 0.1 and 4.8, each lives 0.2 s longer
    assert _harmed(g, 2.1, 0.15) == 10  # alive until 2.2 now, 0.1 s to spare
    g.charge(0, 1.6, 0.2)  # past the short one's SLO: no longer guarded
    assert _harmed(g, 1.7, 4.5) == 0 and _harmed(g, 1.7, 4.7) == 400


def test_a_full_row_grows_and_a_finished_decode_frees_its_cell() -> None:
    g = DecodeGuard(slots=1)
    for i in range(20):
        g.add(0, start=0.0, end=1.0 + i, tokens=2, slack=1.0, now=0.0)
    assert _harmed(g, 0.5, 2.0) == 40
    g.ensure(3)
    assert g.end.shape[0] >= 3 and _harmed(g, 10.5, 2.0) == 2 * 10  # ends 11 .. 20 still alive
    cols = g.end.shape[1]
    g.add(0, start=30.0, end=31.0, tokens=3, slack=1.0, now=25.0)  # every earlier one ended: a cell is reused
    assert g.end.shape[1] == cols and _harmed(g, 30.5, 2.0) == 3


def _view(wid: str, accelerator: str, running: int = 0) -> WorkerView:
    return WorkerView(worker_id=wid, model="llama-3.1-70b", accelerator=accelerator, vendor=accelerator.split("-")[0],
                      devices=8, role=Role.BOTH, queue_depth=0, running=running, max_batch=64, kv_blocks_total=0,
                      kv_blocks_used=0, block_size=16)


def test_the_cost_policy_keeps_a_long_prefill_off_a_worker_holding_a_fragile_decode() -> None:
    """A 4-token decode on the faster worker has 3 x (100 ms - its step) to spare; an 8K-token prefill beside it
    takes more than that from it. With admission on the policy spares it and prefills on the slower worker;
    with admission off (no SLO kept but its own) it takes the faster one."""
    for margin, expect in ((1.0, "slow"), (0.0, "fast")):
        p = make_policy("cost", ttft_slo_s=2.0, tpot_slo_s=0.1, admission_margin=margin)
        first = p.place(RequestInfo(request_id="a", model="llama-3.1-70b", prompt_len=1000, max_tokens=4,
                                    arrival=0.0), [_view("fast", "nvidia-h200"), _view("slow", "nvidia-a100-80g")])
        assert first is not None and first.mode == "aggregated" and first.decode_worker == "fast"
        at = (first.predicted_ttft_s or 0.0) + 1e-3  # its prefill done, its decode running
        second = p.place(RequestInfo(request_id="b", model="llama-3.1-70b", prompt_len=8000, max_tokens=200,
                                     arrival=at), [_view("fast", "nvidia-h200", running=1),
                                                   _view("slow", "nvidia-a100-80g")])
        assert second is not None and (second.prefill_worker or second.decode_worker) == expect, (margin, second)


def test_a_decode_is_never_priced_slower_than_a_step_carrying_a_full_prefill_chunk() -> None:
    """The share's TPOT, step / (1 - share), grows without bound as prefill fills the worker, but the decodes
    ride along in every step, and a step carries at most one chunk of prefill. On a data-parallel VR200 a
    chunk is split eight ways, so with the share at its 0.95 cap the chunk-step bound is what prices it."""
    w = [WorkerView(worker_id="v", model="llama-3.1-70b", accelerator="nvidia-rubin-vr200", vendor="nvidia",
                    devices=8, role=Role.BOTH, queue_depth=0, running=0, max_batch=64, kv_blocks_total=0,
                    kv_blocks_used=0, block_size=16, parallel="dp")]
    p = make_policy("cost", admission_margin=0.0)

    def short(at: float) -> float:
        d = p.place(RequestInfo(request_id="s", model="llama-3.1-70b", prompt_len=100, max_tokens=100, arrival=at), w)
        assert d is not None and d.predicted_tpot_s is not None
        return d.predicted_tpot_s

    plain = short(0.0)  # no prefill placed yet: the plain decode step
    for i in range(400):  # far more prefill than the worker can run: the share saturates
        p.place(RequestInfo(request_id=f"l{i}", model="llama-3.1-70b", prompt_len=16_000, max_tokens=1,
                            arrival=1e-3 * i), w)
    busy = short(0.5)
    assert plain < busy < 0.5 * plain / (1 - 0.95)
