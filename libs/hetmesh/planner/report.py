"""Plans and purchases as text for people: the one wording of goodput, refusals and server mixes
(`hetmesh plan` prints them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hetmesh.costmodel import accelerator
from hetmesh.costmodel.economics import assumed_prices, basis

# Below this share of requests within their SLOs a plan says plainly that the fleet falls short.
SHORT_OF = 0.9


def servers(counts: Mapping[str, int], assumed: Iterable[str] = ()) -> str:
    """{'nvidia-h100': 2, 'amd-mi300x': 1} -> '1x amd-mi300x + 2x nvidia-h100'; a kind in `assumed` gets a *."""
    marked = set(assumed)
    return " + ".join(f"{n}x {k}{'*' if k in marked else ''}" for k, n in sorted(counts.items()) if n) or "nothing"


def price_lines(used: Iterable[str], verb: str, prices: Mapping[str, float] | None = None) -> list[str]:
    """The price basis of a plan, and a line for each accelerator it `verb`s (buys, runs on) whose price
    is the catalog's estimate rather than a listed rate: a choice that rests on it may not hold."""
    out = [f"prices: {basis(prices)}"]
    for a in assumed_prices(used, prices):
        acc = accelerator(a)
        out.append(f"{verb} {a}: its price is assumed, not listed (${acc.usd_per_hour:,.2f} per device-hour: "
                   f"{acc.price_source}); give yours with --price {a}=USD")
    return out


def attainment(slo_attainment: float, refused: int, offered: int) -> str:
    """'1,746 of 3,993 requests refused (54.4% SLO attainment)', or the attainment with none refused."""
    if refused:
        return f"{refused:,} of {offered:,} requests refused ({slo_attainment:.1%} SLO attainment)"
    return f"{slo_attainment:.1%} SLO attainment of {offered:,} requests, none refused"


def summary(predicted: Mapping[str, Any]) -> list[str]:
    """A simulated summary from `evaluate` (a plan's `predicted`): goodput, refusals, $, and a warning
    where the layout leaves many requests outside their SLOs."""
    att = predicted["slo_attainment"]
    out = [f"goodput {predicted['goodput_tok_s']:,.1f} tok/s (SLO-meeting output tokens per second of the "
           f"demand's span); {attainment(att, predicted['refused_requests'], predicted['offered_requests'])}",
           f"${predicted['usd_per_hour']:,.2f}/h, ${predicted['usd_per_good_mtok']:,.2f} per million good tokens"]
    if att < SHORT_OF:
        out.append(f"short of the demand: the best layout of these servers meets the SLOs for {att:.1%} of "
                   "requests; add servers, or relax the SLOs")
    return out
