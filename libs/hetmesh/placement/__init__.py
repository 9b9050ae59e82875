"""The placement core: cluster state + request in, decision out. No I/O.

The scheduler service and the offline simulator (hetmesh.sim) drive the very same objects.
"""

from hetmesh.placement.admission import REFUSED
from hetmesh.placement.dynamo import Dynamo
from hetmesh.placement.llmd import LlmD
from hetmesh.placement.policies import (
    POLICIES,
    LeastLoaded,
    Policy,
    PrefixAware,
    RoundRobin,
    aggregated,
    make_policy,
)
from hetmesh.placement.state import ClusterState, Decision, RequestInfo, WorkerView, exclusion, pool_full

__all__ = [
    "POLICIES",
    "REFUSED",
    "ClusterState",
    "Decision",
    "Dynamo",
    "LeastLoaded",
    "LlmD",
    "Policy",
    "PrefixAware",
    "RequestInfo",
    "RoundRobin",
    "WorkerView",
    "aggregated",
    "exclusion",
    "make_policy",
    "pool_full",
]
