"""Cost model: accelerator and model catalogs, step-time predictions, calibration. Pure.

    from hetmesh.costmodel import CostModel, accelerator, model_spec
    cm = CostModel(accelerator("amd-mi300x"), model_spec("deepseek-r1"), devices=8)
    cm.prefill_time(4096), cm.decode_step_time(32, 32 * 4096), cm.max_kv_tokens()
"""

from hetmesh.costmodel.calibrate import Sample, calibrate, server_model
from hetmesh.costmodel.catalog import (
    DTYPE_BYTES,
    Accelerator,
    ModelSpec,
    accelerator,
    accelerators,
    model_ids,
    model_spec,
)
from hetmesh.costmodel.efficiency import (
    Efficiency,
    EfficiencyFileError,
    default_efficiency,
    load_efficiencies,
    save_efficiencies,
)
from hetmesh.costmodel.model import CostModel, link_bandwidth, transfer_time

__all__ = [
    "DTYPE_BYTES",
    "Accelerator",
    "CostModel",
    "Efficiency",
    "EfficiencyFileError",
    "ModelSpec",
    "Sample",
    "accelerator",
    "accelerators",
    "calibrate",
    "default_efficiency",
    "link_bandwidth",
    "load_efficiencies",
    "model_ids",
    "model_spec",
    "save_efficiencies",
    "server_model",
    "transfer_time",
]
