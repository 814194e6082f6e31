"""Transfer backends (NIXL)."""
