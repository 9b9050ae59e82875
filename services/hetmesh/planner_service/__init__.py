"""The planner service, the shell around hetmesh.planner: `python -m hetmesh.planner --cluster F`.

(`hetmesh.planner` is the pure planner's package, so the shell lives here and that package's
`__main__` starts it: one package name cannot span libs/ and services/ once installed.)
"""
