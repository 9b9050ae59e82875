"""The planner service, the shell around the pure `hetmesh.planner`: `python -m hetmesh.planner_service --cluster F`."""
