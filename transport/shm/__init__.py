"""Same-host backend (cross-memory attach)."""
