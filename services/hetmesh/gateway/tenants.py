"""Which tenant a request is (flow control's, hetmesh.placement.flow), and the tenant's own rate limits.

With API keys on, the key names it ([[tenants]] keys; a key in no tenant: the default tenant); with keys off,
the request may name it in the flow header (`x-hetmesh-tenant`): an unknown one gets 400 naming the header.
A tenant's rpm/tpm buckets are `auth.KeyState`s under a key of their own, so they share the per-key buckets'
code, in this process or through Redis across gateways (limits.SharedBuckets).
"""

from __future__ import annotations

from hetmesh.config import ApiKey, ClusterConfig, hash_key
from hetmesh.protocol import ErrorInfo

from .auth import KeyState, TokenBucket, Verdict


def _bucket(limit: int) -> TokenBucket | None:
    return TokenBucket(float(limit)) if limit > 0 else None


class Tenants:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.on = bool(cfg.tenants)
        self.header = cfg.flow.header.lower()
        self.names = {t.name for t in cfg.tenants}
        self.by_key = {k: t.name for t in cfg.tenants for k in t.keys}
        self.buckets = {t.name: KeyState(ApiKey(name=f"tenant {t.name}", sha256=hash_key(f"hetmesh-tenant:{t.name}")),
                                         _bucket(t.rpm), _bucket(t.tpm))
                        for t in cfg.tenants if t.rpm or t.tpm}

    @property
    def limited(self) -> bool:
        return bool(self.buckets)

    def resolve(self, v: Verdict, headers: object) -> tuple[str, ErrorInfo | None]:
        """The request's tenant ("" the default one), or the 400 for a tenant header naming none."""
        if not self.on:
            return "", None
        if v.key is not None:
            return self.by_key.get(v.key.key.name, ""), None
        named = headers.get(self.header)  # type: ignore[attr-defined]
        if named is None:
            return "", None
        if named not in self.names:
            return "", ErrorInfo(message=f"unknown tenant {named!r} in header {self.header}: the cluster file's "
                                 f"tenants are {sorted(self.names)}", type="invalid_request_error",
                                 code="unknown_tenant", param=self.header, status=400)
        return named, None

    def state(self, tenant: str) -> KeyState | None:
        return self.buckets.get(tenant)
