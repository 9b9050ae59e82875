"""Start a whole mesh (infrastructure + every service as its own process) from a cluster file."""

from hetmesh.launcher.mesh import Mesh

__all__ = ["Mesh"]
