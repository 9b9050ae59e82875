"""A vLLM worker switches role without restarting its engine (the planner's RoleSwitch): how the engine
is built for it.

Every engine is built with its KV connector in `kv_role = "kv_both"` (vllm_engine.VllmEngine.engine_args):
vLLM then counts it as a KV producer and a KV consumer at once (KVTransferConfig.is_kv_producer and
is_kv_consumer), and which side a request is on comes from its own kv_transfer_params
(`do_remote_decode` on a prefill, the hand-over's `do_remote_prefill` on a decode). So the same running
engine prefills for others, decodes from others' KV and serves whole requests, and a role switch only
changes the worker's work subscriptions. The switch itself, on running engines, is
test_mesh.py's `test_prefill_and_decode_workers_swap_roles_without_a_restart` (on that module's mesh:
no more engines to start); test_engine.py has each engine serve both phases.
"""

from __future__ import annotations

from pathlib import Path

from hetmesh.engines.vllm_engine import VllmConfig, VllmEngine


def test_every_connector_is_built_for_both_roles(tmp_path: Path) -> None:
    for connector in ("hetmesh", "nixl"):
        e = VllmEngine(VllmConfig(model_dir=str(tmp_path), model_name="m", kv_connector=connector,
                                  spool_dir=str(tmp_path)))
        kv = e.engine_args().kv_transfer_config
        assert kv.kv_role == "kv_both" and kv.is_kv_producer and kv.is_kv_consumer, connector
