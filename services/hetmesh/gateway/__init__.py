"""The OpenAI-compatible HTTP front door of the mesh (`python -m hetmesh.gateway`)."""
