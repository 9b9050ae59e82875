"""The kv-transfer service (`python -m hetmesh.kv_transfer --cluster F [--instance ID]`)."""

from hetmesh.kv_transfer.service import KvTransferService

__all__ = ["KvTransferService"]
