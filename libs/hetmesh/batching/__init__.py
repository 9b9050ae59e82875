"""The one batching core (`Core`: schedule / update over plain data) and the KV memory it manages.

Both the live `sim` engine (hetmesh.engines.simulated) and the offline cluster simulator
(hetmesh.sim.cluster) drive it; `hetmesh.wiring` builds its `Settings` from the cluster file.
"""

from hetmesh.batching.cache import KvEventBatch, PrefixCache
from hetmesh.batching.core import (
    PREFILL_ORDERS,
    Core,
    Kind,
    Outcome,
    Seq,
    Settings,
    State,
    Step,
    blocks_for,
    following,
)

__all__ = ["PREFILL_ORDERS", "Core", "Kind", "KvEventBatch", "Outcome", "PrefixCache", "Seq", "Settings", "State",
           "Step", "blocks_for", "following"]
