"""Adapters that plug pallas_flash into model libraries (each an optional dependency)."""
