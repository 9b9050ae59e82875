"""The scheduler service: live cluster view + prefix index -> placement -> worker subjects."""
