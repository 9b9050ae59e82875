from hetmesh.protocol import Role
from hetmesh.worker.service import main

if __name__ == "__main__":
    main(default_role=Role.PREFILL)
