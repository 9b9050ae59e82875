"""The one batching core (`Core`: schedule / update, core.py) over plain data (data.py) and the KV memory
it manages (cache.py).

Both the live `sim` engine (hetmesh.engines.simulated) and the offline cluster simulator
(hetmesh.sim.cluster) drive it; `hetmesh.wiring` builds its `Settings` from the cluster file.
"""

from hetmesh.batching.cache import KvEventBatch, PrefixCache
from hetmesh.batching.core import Core
from hetmesh.batching.data import (
           PREFILL_ORDERS,
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
