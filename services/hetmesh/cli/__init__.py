"""`hetmesh`: operator commands against a running mesh (`hetmesh status`)."""
