"""The fleet planner (pure): which server runs which model, in which role and parallel layout, and
which chips to buy, from the cost model, checked by the simulator.

    from hetmesh.planner import ModelDemand, ServerGroup, plan
    p = plan([ServerGroup(name="mi300x", accelerator="amd-mi300x", count=1),
              ServerGroup(name="mi308x", accelerator="amd-mi308x", count=2)],
             [ModelDemand(name="r1", spec="deepseek-r1", rate=0.5, input_mean=2048, output_mean=256)])
"""

from hetmesh.planner.inputs import ModelDemand, ServerGroup, demand_from_trace, length_buckets
from hetmesh.planner.plan import (
           Assignment,
           CandidateResult,
           Move,
           Plan,
           demand_trace,
           evaluate,
           moves,
           options,
           plan,
)

__all__ = ["Assignment", "CandidateResult", "ModelDemand", "Move", "Plan", "ServerGroup", "demand_from_trace",
           "demand_trace", "evaluate", "length_buckets", "moves", "options", "plan"]
