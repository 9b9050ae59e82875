"""`python -m hetmesh.prefill_worker`: the worker with role `prefill` unless --role says otherwise."""
