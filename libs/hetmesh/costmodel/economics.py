"""Prices: $ per hour of a fleet and $ per million output tokens. The catalog's list prices
(accelerators.csv, each with its source or marked an assumption), overridden per accelerator by a
cluster file's [prices] table."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hetmesh.costmodel.catalog import accelerator


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
