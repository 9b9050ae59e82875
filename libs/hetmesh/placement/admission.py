"""SLO-aware admission (early rejection, as Mooncake's overload-oriented scheduling, FAST'25 section 7).

A request is refused when even its best placement is predicted over `margin` x its TTFT or TPOT SLO: served
late it brings no goodput and makes the requests behind it late too. One that would miss its SLO even on an
idle worker is judged against that idle figure and served only while it holds up no one. Before refusing,
the shell may hold the request and place it again (`hold_s`) while its TTFT is still in reach. Pure
functions: predictions in, verdict out. The rule in full: docs/placement.md (Admission).
"""

from __future__ import annotations

import math

from hetmesh.placement.state import Decision

REFUSED = "refused"  # Decision.mode of a request refused by admission
MAX_RETRY_AFTER_S = 60.0
# On unless a model or the scheduler says otherwise: without it goodput collapses past capacity
# (benchmarks/anchors.py, results/anchors.json). One default for the live scheduler and the simulator,
# so that a simulated layout (the planner's check) is judged under the admission the mesh runs.
DEFAULT_MARGIN = 1.0
# A refusal is held and the request placed again this often while its TTFT SLO is still within reach: a
# refusal for TPOT is mostly a burst of prefill on the decoders, over in a second or two. One default for the
# live scheduler and the simulator; a shorter interval gains nothing on benchmarks/anchors.py.
DEFAULT_HOLD_S = 0.25


def over_slo(ttft_s: float, tpot_s: float, output_tokens: int, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """How many times its SLO a placement is predicted to take (<= 1: within both)."""
    over = ttft_s / ttft_slo_s
    if output_tokens > 1:
        over = max(over, tpot_s / tpot_slo_s)
    return over


def admit(best_over: float, margin: float, idle_over: float = 0.0, arrivals: float = 0.0) -> bool:
    """The rule: admit unless admission is on and the best placement is over `margin` x its SLO. `idle_over`:
    the best over with no load (prefill alone, decode alone); a request that cannot meet its SLO even then is
    judged against that, so only what load adds refuses it (retrying would never help), and only while no
    other request is expected at its prefill worker as long as it prefills there (`arrivals` < 1): it brings
    no goodput, and at load it would hold up the requests that could still meet theirs."""
    if margin <= 0 or best_over <= margin:
        return True
    return best_over <= margin * idle_over and arrivals < 1.0


def retry_after_s(ttft_s: float, ttft_slo_s: float, margin: float, floor_s: float, idle_over: float = 0.0) -> float:
    """What Retry-After says: the predicted wait past what admission allows (the backlog that must drain
    first), at least `floor_s`, at most a minute."""
    return min(max(ttft_s - margin * max(1.0, idle_over) * ttft_slo_s, floor_s), MAX_RETRY_AFTER_S)


def retry_wait_s(refused: Decision, floor_s: float) -> float:
    """The Retry-After a refusal is answered with (live) or a simulated client waits (the simulator)."""
    return min(max(refused.retry_after_s or 0.0, floor_s), MAX_RETRY_AFTER_S)


def hold_s(ttft_s: float, waited_s: float, recheck_s: float, margin: float, ttft_slo_s: float,
           idle_over: float = 0.0) -> float | None:
    """How long the scheduler may hold a refused request before placing it again: `recheck_s`, while its TTFT
    (the wait so far, that long again, and the TTFT predicted now) would still be within what admission allows;
    None: refuse now (or holding is off, recheck_s 0)."""
    if recheck_s <= 0 or waited_s + recheck_s + ttft_s > margin * max(1.0, idle_over) * ttft_slo_s:
        return None
    return recheck_s


def hold_wait_s(refused: Decision, waited_s: float, limit_s: float) -> float | None:
    """How long the scheduler (or the simulator) holds a refusal before placing the request again: the policy's
    hold_s while the request's whole wait stays within `limit_s` (live: half the gateway's submit timeout, so
    the client is answered before the gateway gives up); None: answer the refusal now."""
    h = refused.hold_s
    return h if h is not None and waited_s + h <= limit_s else None


def quiet_s(best_over: float, margin: float, idle_over: float, arrivals: float, window_s: float) -> float:
    """For a request refused only for the requests it would hold up (admitted by the idle exception but for
    `arrivals`): how long until fewer than one is expected at its prefill worker during its prefill, if no more
    came (the rate decays over `window_s`); 0 for any other refusal."""
    if arrivals <= 1.0 or best_over > margin * idle_over:
        return 0.0
    return window_s * math.log(arrivals)


def refusal(ttft_s: float, tpot_s: float, best_over: float, margin: float, ttft_slo_s: float,
            idle_over: float, waited_s: float = 0.0, recheck_s: float = 0.0, quiet: float = 0.0) -> Decision:
    """The Decision a policy returns for a refused request (no worker; the predictions that refused it, its
    retry_after_s before the scheduler's floor, at least `quiet` for a request refused for the requests it would
    hold up, and how long it may be held instead)."""
    return Decision(mode=REFUSED, decode_worker="", predicted_ttft_s=ttft_s, predicted_tpot_s=tpot_s,
                    retry_after_s=max(retry_after_s(ttft_s, ttft_slo_s, margin, 0.0, idle_over),
                                      min(quiet, MAX_RETRY_AFTER_S)),
                    hold_s=hold_s(ttft_s, waited_s, recheck_s, margin, ttft_slo_s, idle_over),
                    reason=refusal_reason(ttft_s, tpot_s, best_over, margin, ttft_slo_s, idle_over, waited_s))


def _ratio(x: float, margin: float) -> str:
    """`x` with the digits that tell it from `margin` (1.0004 is not printed as 1.00 against a margin of 1)."""
    for digits in range(3, 9):
        if f"{x:.{digits}g}" != f"{margin:.{digits}g}":
            return f"{x:.{digits}g}"
    return f"{x!r}"


def refusal_reason(ttft_s: float, tpot_s: float, best_over: float, margin: float, ttft_slo_s: float,
                   idle_over: float, waited_s: float = 0.0) -> str:
    """What the best placement was predicted to exceed, and by how much: its TTFT (the wait so far included) or
    its TPOT, against margin x the SLO; or, over its SLO even on an idle worker, the requests it would hold up."""
    ttft = ttft_s + waited_s
    if ttft / ttft_slo_s >= best_over * (1 - 1e-9):
        waited = f" ({waited_s:.3g} s waited already)" if waited_s > 0 else ""
        what = f"predicted TTFT {ttft:.4g} s{waited} is {_ratio(ttft / ttft_slo_s, margin)}x its {ttft_slo_s:g} s SLO"
    else:
        what = (f"predicted TPOT {tpot_s * 1000:.3g} ms is {_ratio(best_over, margin)}x its "
                f"{tpot_s / best_over * 1000:.3g} ms SLO")
    if best_over <= margin * idle_over:  # admitted by the idle exception but for the requests it would hold up
        return (f"admission: {what}, as it would be on an idle worker, and requests behind it would wait; "
                f"served only while none is expected")
    return f"admission: {what} > margin {margin:g}"
