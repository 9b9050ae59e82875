"""`python -m hetmesh.planner`: the planner service (its shell is hetmesh.planner_service)."""

from hetmesh.planner_service.service import main

if __name__ == "__main__":
    main()
