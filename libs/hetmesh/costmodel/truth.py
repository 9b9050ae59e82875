"""What a simulated worker really runs at, unknown to the scheduler and the planner (they price the prior).

The simulator and the sim engine time each step with the true efficiency factors, times a slowdown from a
given engine time on, so any benchmark can ask what happens when the priors are wrong or a chip degrades.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetmesh.costmodel.efficiency import Efficiency


@dataclass(frozen=True)
class Truth:
    efficiency: Efficiency | None = None  # the real factors (None: the prior's)
    slowdown: float = 1.0  # steps take this many times longer ...
    after_s: float = 0.0  # ... from this engine time on

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise ValueError(f"slowdown must be > 0, got {self.slowdown}")

    def factor(self, now: float) -> float:
        return self.slowdown if now >= self.after_s else 1.0
