"""The worker service: one engine behind NATS (`python -m hetmesh.worker --cluster F --worker-id ID`)."""

from hetmesh.worker.service import Worker

__all__ = ["Worker"]
