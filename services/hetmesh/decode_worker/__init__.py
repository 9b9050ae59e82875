"""`python -m hetmesh.decode_worker`: the worker with role `decode` unless --role says otherwise."""
