"""Prices: $ per hour of a fleet and $ per million output tokens. The catalog's prices
(accelerators.csv: one stated basis, each price listed or assumed, with its source), overridden per
accelerator by a cluster file's [prices] table."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hetmesh.costmodel.catalog import accelerator, price_basis


def device_usd_per_hour(accelerator_id: str, prices: Mapping[str, float] | None = None) -> float:
    """$ per device-hour of an accelerator: the override where there is one, else the catalog's."""
    if prices and accelerator_id in prices:
        return float(prices[accelerator_id])
    return accelerator(accelerator_id).usd_per_hour


def fleet_usd_per_hour(servers: Iterable[tuple[str, int]], prices: Mapping[str, float] | None = None) -> float:
    """$ per hour of servers given as (accelerator id, devices) pairs."""
    return sum(device_usd_per_hour(acc, prices) * devices for acc, devices in servers)


def usd_per_mtok(usd_per_hour: float, tokens_per_s: float) -> float:
    """$ per million tokens at a steady `tokens_per_s`; inf when nothing is produced."""
    return usd_per_hour / (tokens_per_s * 3.6e-3) if tokens_per_s > 0 else float("inf")


def assumed_prices(accelerator_ids: Iterable[str], prices: Mapping[str, float] | None = None) -> list[str]:
    """Those of `accelerator_ids` priced by the catalog's estimate rather than a listed rate (a price
    given in `prices` is the caller's own, not assumed), sorted."""
    return sorted({a for a in accelerator_ids
                   if not (prices and a in prices) and accelerator(a).price_confidence == "assumed"})


def basis(prices: Mapping[str, float] | None = None) -> str:
    """The price basis a plan rests on: the catalog's, and which accelerators the caller priced instead."""
    own = f", except {', '.join(sorted(prices))}: the prices given" if prices else ""
    return f"{price_basis()} (the catalog's){own}"
