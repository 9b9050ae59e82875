"""`python -m hetmesh.planner_service`: the live planner service."""

from hetmesh.planner_service.service import main

if __name__ == "__main__":
    main()
